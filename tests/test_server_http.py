"""SGLang native HTTP API over the real Engine (embedded model): shapes and values of the replies."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from conftest import serve_app

GREEDY = {"temperature": 0, "max_new_tokens": 4}
PROMPTS = ["The capital of France is", "One two three four"]


def _post(url: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(url + "/generate", json=body, timeout=300, **kw)


@pytest.fixture(scope="module")
def singles(server) -> list[dict]:
    """Greedy replies for PROMPTS, one request each."""
    outs = []
    for p in PROMPTS:
        r = _post(server.url, {"text": p, "sampling_params": GREEDY})
        assert r.status_code == 200, r.text
        outs.append(r.json())
    return outs


def test_generate_text_reply_shape(server, singles):
    tok = server.engine.tokenizer
    for prompt, out in zip(PROMPTS, singles, strict=True):
        meta = out["meta_info"]
        assert len(out["output_ids"]) == 4
        assert out["text"] == tok.decode(out["output_ids"])
        assert meta["prompt_tokens"] == len(tok.encode(prompt))
        assert meta["completion_tokens"] == 4
        assert meta["finish_reason"] == {"type": "length", "length": 4}
        assert isinstance(meta["id"], str) and meta["cached_tokens"] >= 0


def test_generate_input_ids_matches_text(server, singles):
    ids = server.engine.tokenizer.encode(PROMPTS[0])
    r = _post(server.url, {"input_ids": ids, "sampling_params": GREEDY, "rid": "ids-req"})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["output_ids"] == singles[0]["output_ids"]
    assert out["meta_info"]["id"] == "ids-req"


def test_generate_batch_of_two_texts(server, singles):
    r = _post(server.url, {"text": PROMPTS, "sampling_params": GREEDY})
    assert r.status_code == 200, r.text
    outs = r.json()
    assert isinstance(outs, list) and len(outs) == 2
    for got, single in zip(outs, singles, strict=True):
        assert got["output_ids"] == single["output_ids"]
        assert got["meta_info"]["prompt_tokens"] == single["meta_info"]["prompt_tokens"]


def test_generate_stream_cumulative(server, singles):
    chunks, done = [], False
    with httpx.stream("POST", server.url + "/generate", timeout=300,
                      json={"text": PROMPTS[0], "sampling_params": GREEDY, "stream": True}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if not line:
                continue
            assert line.startswith("data: ")
            payload = line[len("data: "):]
            if payload == "[DONE]":
                done = True
                continue
            assert not done, "nothing may follow [DONE]"
            chunks.append(json.loads(payload))
    assert done and chunks
    for prev, cur in zip(chunks, chunks[1:], strict=False):
        assert cur["text"].startswith(prev["text"])
        assert prev["meta_info"]["finish_reason"] is None
    final = chunks[-1]
    assert final["meta_info"]["finish_reason"] == {"type": "length", "length": 4}
    assert final["output_ids"] == singles[0]["output_ids"]
    assert final["text"] == singles[0]["text"]


def test_prompt_logprobs_like_sgl_select(server):
    """`sgl.select` scoring: a batch, max_new_tokens 0, return_logprob, logprob_start_len 0."""
    tok = server.engine.tokenizer
    body = {"text": PROMPTS, "sampling_params": {"max_new_tokens": 0, "temperature": 0},
            "return_logprob": True, "logprob_start_len": 0, "return_text_in_logprobs": True}
    r = _post(server.url, body)
    assert r.status_code == 200, r.text
    for prompt, out in zip(PROMPTS, r.json(), strict=True):
        ids = tok.encode(prompt)
        lps = out["meta_info"]["input_token_logprobs"]
        assert len(lps) == len(ids) == out["meta_info"]["prompt_tokens"]
        assert out["output_ids"] == [] and out["meta_info"]["completion_tokens"] == 0
        assert lps[0][0] is None
        assert [t[1] for t in lps] == ids
        assert all(isinstance(t[0], float) and t[0] <= 0.0 for t in lps[1:])
        assert [t[2] for t in lps] == [tok.decode([i], skip_special_tokens=False) for i in ids]


def test_info_routes(server):
    eng = server.engine
    for path in ("/get_model_info", "/model_info"):
        info = httpx.get(server.url + path).json()
        assert info["model_path"] == eng.model_path
        assert info["is_generation"] is True
        assert info["served_model_name"] == eng.served_model_name
        assert "tokenizer_path" in info
    for path in ("/get_server_info", "/server_info"):
        info = httpx.get(server.url + path).json()
        assert info["context_length"] == eng.context_length
        assert {"kv_pages_total", "kv_pages_free", "gdn_slots_total", "gdn_slots_free"} <= set(info["memory"])
    health = httpx.get(server.url + "/health")
    assert health.status_code == 200 and health.content == b""
    assert httpx.get(server.url + "/health_generate", timeout=120).status_code == 200
    for method in ("GET", "POST"):
        r = httpx.request(method, server.url + "/flush_cache")
        assert r.status_code == 200 and "Cache flushed" in r.text
    assert httpx.post(server.url + "/abort_request", json={"rid": "no-such-request"}).status_code == 200
    assert httpx.get(server.url + "/version").status_code == 404


def test_metrics_exposition(server, singles):
    r = httpx.get(server.url + "/metrics")
    assert r.status_code == 200
    text = r.text
    for name in ("sglang:num_requests_total", "sglang:prompt_tokens_total", "sglang:generation_tokens_total",
                 "sglang:time_to_first_token_seconds_bucket", "sglang:e2e_request_latency_seconds_count",
                 "sglang:num_running_reqs", "sglang:kv_pages_total"):
        assert name in text, name
    generated = [ln for ln in text.splitlines() if ln.startswith("sglang:generation_tokens_total ")]
    assert float(generated[0].split()[1]) >= 4 * len(singles)


def _wait_idle(url: str, timeout_s: float = 120.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        info = httpx.get(url + "/get_server_info", timeout=30).json()
        if info["num_running"] == 0 and info["num_waiting"] == 0:
            # Idle: empty the prefix cache, whose pages are not free until flushed.
            httpx.post(url + "/flush_cache", timeout=60)
            info = httpx.get(url + "/get_server_info", timeout=30).json()
        mem = info["memory"]
        idle = (info["num_running"] == 0 and info["num_waiting"] == 0
                and mem["kv_pages_free"] == mem["kv_pages_total"]
                and mem["gdn_slots_free"] == mem["gdn_slots_total"])
        if idle or time.monotonic() > deadline:
            return info
        time.sleep(0.2)


def _request(engine, rid: str):
    return next((r for r in [*engine.scheduler.running, *engine.scheduler.waiting] if r.rid == rid), None)


def _wait_for(pred, what: str, timeout_s: float = 120.0):
    deadline = time.monotonic() + timeout_s
    while not (value := pred()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)
    return value


def test_disconnect_aborts_and_frees_memory(server):
    """A client that goes away aborts its request (memory freed). The request cannot finish on its own first:
    it runs to the end of the context with ignore_eos, and its step is held on an event (the fault hook's
    block) until the server has seen the disconnect, so no machine is too fast or too slow for this test."""
    eng = server.engine
    to_context_end = eng.context_length - len(eng.tokenizer.encode(PROMPTS[1]))
    body = {"text": PROMPTS[1], "stream": True, "sampling_params": {"max_new_tokens": to_context_end,
                                                                    "temperature": 0, "ignore_eos": True}}
    for stream in (True, False):
        rid = f"disconnect-{stream}"
        gate = threading.Event()
        # Hold its second decode step: under overlap scheduling the first chunk is sent once the first decode step
        # has been launched, so holding that one would keep the chunk the client waits for.
        fault = eng.scheduler.faults.arm("forward", rid=rid, skip=2, block=gate)
        try:
            if stream:
                with httpx.stream("POST", server.url + "/generate", json={**body, "rid": rid}, timeout=300) as r:
                    for line in r.iter_lines():
                        if line.startswith("data: "):
                            break  # one chunk, then hang up mid-generation
            else:
                with pytest.raises(httpx.ReadTimeout):  # the step is held: no reply can come in time
                    httpx.post(server.url + "/generate", json={**body, "rid": rid, "stream": False}, timeout=1.0)
            req = _wait_for(lambda: _request(eng, rid), "the request")  # noqa: B023
            _wait_for(lambda: req.aborted, "the server to see the disconnect")  # noqa: B023
        finally:
            gate.set()
            eng.scheduler.faults.disarm(fault)
        _wait_for(lambda: req.finished, "the abort")  # noqa: B023
        assert req.finish_reason["type"] == "abort" and "status_code" not in req.finish_reason
        assert len(req.output_ids) < to_context_end
        info = _wait_idle(server.url)
        assert info["num_running"] == 0
        assert info["memory"]["kv_pages_free"] == info["memory"]["kv_pages_total"]
        assert info["memory"]["gdn_slots_free"] == info["memory"]["gdn_slots_total"]


def test_api_key(server):
    from sglang_tpu_qwen.server.app import create_app

    with serve_app(create_app(server.engine, api_key="sk-test")) as url:
        assert httpx.get(url + "/get_model_info").status_code == 401
        assert httpx.get(url + "/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
        ok = httpx.get(url + "/get_model_info", headers={"Authorization": "Bearer sk-test"})
        assert ok.status_code == 200 and ok.json()["is_generation"] is True
        assert httpx.get(url + "/health").status_code == 200
