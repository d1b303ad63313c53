"""Prefill/decode disaggregation over TCP behind the real `smg` router: exact outputs, failure handling.

One prefill server (page size 16, context 256) and one decode server (page size 8, context 512) run as
subprocesses on loopback with the memory-invariant check on; `smg launch --pd-disaggregation` routes. The
reference is the colocated in-process engine of conftest (page size 16). Destructive tests (a server
killed) come last in the module.
"""

from __future__ import annotations

import concurrent.futures
import time

import httpx
import numpy as np
import pytest
from conftest import record
from pd_harness import SMALL, RouterProc, ServerProc, assert_idle_and_free, mixed_prompts, wait_for

from sglang_tpu_qwen.disagg.receiver import CONNECT_GRACE_S

PREFILL_TIMEOUT_S = 6.0


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    """(prefill, decode, router, bootstrap_port); torn down at module end (whatever a test killed)."""
    from conftest import free_port

    logs = tmp_path_factory.mktemp("pd_tcp")
    bport = free_port()
    prefill = ServerProc.start(logs, "prefill", [*SMALL, "--page-size", "16", "--disaggregation-mode", "prefill",
                                                 "--disaggregation-bootstrap-port", str(bport),
                                                 "--disaggregation-timeout", str(PREFILL_TIMEOUT_S)])
    decode = router = None
    try:
        decode = ServerProc.start(logs, "decode", [*SMALL, "--context-length", "512", "--page-size", "8",
                                                   "--disaggregation-mode", "decode",
                                                   "--disaggregation-timeout", "60"])
        router = RouterProc.start(logs, prefill, bport, decode)
        yield prefill, decode, router, bport
    finally:
        for p in (router, decode, prefill):
            if p is not None:
                p.stop()


def _generate(url: str, body: dict, timeout: float = 300) -> httpx.Response:
    return httpx.post(url + "/generate", json=body, timeout=timeout)


def test_concurrent_prompts_match_colocated(pd, engine):
    prefill, decode, router, _ = pd
    prompts = mixed_prompts()
    sp = [{"temperature": 0, "max_new_tokens": 8 + 4 * (i % 3)} for i in range(len(prompts))]
    want = [engine.generate(input_ids=p, sampling_params=s)["output_ids"] for p, s in zip(prompts, sp, strict=True)]
    before = decode.info()["disaggregation"]["transfers_done"]
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        replies = list(pool.map(lambda a: _generate(router.url, {"input_ids": a[0], "sampling_params": a[1]}),
                                zip(prompts, sp, strict=True)))
    elapsed = time.perf_counter() - t0
    for r in replies:
        assert r.status_code == 200, r.text
    got = [r.json()["output_ids"] for r in replies]
    assert got == want
    assert decode.info()["disaggregation"]["transfers_done"] - before == len(prompts)
    record("pd", f"TCP PD via smg: 8 concurrent prompts (5-200 tokens), page 16 -> 8: token-identical to colocated, "
                 f"{elapsed:.1f} s")
    assert_idle_and_free(prefill)
    assert_idle_and_free(decode)


def test_logprobs_and_stream_through_router(pd, engine):
    prefill, decode, router, _ = pd
    prompt = mixed_prompts()[6]
    body = {"input_ids": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": 6},
            "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 2}
    want = engine.generate(input_ids=prompt, sampling_params=body["sampling_params"], return_logprob=True,
                           logprob_start_len=0, top_logprobs_num=2)
    r = _generate(router.url, body)
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["output_ids"] == want["output_ids"]
    gm, wm = got["meta_info"], want["meta_info"]
    # The router appends the decode reply's (empty) prompt logprobs to the prefill reply's.
    assert [t[1] for t in gm["input_token_logprobs"]] == prompt
    assert gm["input_token_logprobs"][0][0] is None
    np.testing.assert_allclose([t[0] for t in gm["input_token_logprobs"][1:]],
                               [t[0] for t in wm["input_token_logprobs"][1:]], atol=2e-3)
    # The first token's logprob (and top-2) come from the prefill server inside the transfer.
    assert [t[1] for t in gm["output_token_logprobs"]] == want["output_ids"]
    np.testing.assert_allclose([t[0] for t in gm["output_token_logprobs"]],
                               [t[0] for t in wm["output_token_logprobs"]], atol=2e-3)
    assert [[a[1] for a in x] for x in gm["output_top_logprobs"]] == \
        [[a[1] for a in x] for x in wm["output_top_logprobs"]]

    chunks = []
    with httpx.stream("POST", router.url + "/generate", timeout=300,
                      json={"input_ids": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": 6},
                            "stream": True}) as s:
        assert s.status_code == 200
        for line in s.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(httpx.Response(200, content=line[6:]).json())
    assert chunks and chunks[-1]["output_ids"] == want["output_ids"]
    assert_idle_and_free(prefill)
    assert_idle_and_free(decode)


def test_openai_n2_one_transfer_per_sample(pd, server):
    prefill, decode, router, _ = pd
    model = httpx.get(decode.url + "/v1/models", timeout=30).json()["data"][0]["id"]
    body = {"model": model, "messages": [{"role": "user", "content": "Name three colours."}], "max_tokens": 8,
            "temperature": 0, "n": 2}
    ref = httpx.post(server.url + "/v1/chat/completions", timeout=300,
                     json={**body, "model": server.engine.served_model_name}).json()
    started = prefill.info()["disaggregation"]["transfers_started"]
    done = decode.info()["disaggregation"]["transfers_done"]
    r = httpx.post(router.url + "/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert len(choices) == 2
    assert [c["message"]["content"] for c in choices] == [c["message"]["content"] for c in ref["choices"]]
    assert prefill.info()["disaggregation"]["transfers_started"] - started == 2
    assert decode.info()["disaggregation"]["transfers_done"] - done == 2
    assert_idle_and_free(prefill)
    assert_idle_and_free(decode)


def test_prefill_rejection_reaches_client_as_4xx(pd):
    prefill, decode, router, _ = pd
    # 300 tokens: over the prefill server's context (256), within the decode server's (512).
    long_prompt = [1000 + i for i in range(300)]
    r = _generate(router.url, {"input_ids": long_prompt, "sampling_params": {"max_new_tokens": 4}}, timeout=60)
    assert r.status_code == 400, r.text
    assert "context length" in r.text
    # Rejected by both legs (bad token id): a 400 too, and the prefill's error room is dropped at its timeout.
    r = _generate(router.url, {"input_ids": [10**9], "sampling_params": {"max_new_tokens": 4}}, timeout=60)
    assert r.status_code == 400, r.text
    # The router may answer with the first leg's 400 before the decode leg has finished rejecting.
    wait_for(lambda: decode.info()["disaggregation"]["transfers_waiting"] == 0, 20, "the decode leg to be rejected")
    assert_idle_and_free(decode)
    assert_idle_and_free(prefill, timeout_s=PREFILL_TIMEOUT_S + 10)


def test_abort_mid_transfer_frees_both(pd):
    prefill, decode, router, bport = pd
    # A decode leg whose prefill has not come yet; its client gives up after 1.5 s.
    room = 424242
    body = {"input_ids": mixed_prompts()[7], "sampling_params": {"temperature": 0, "max_new_tokens": 8},
            "bootstrap_host": "127.0.0.1", "bootstrap_port": bport, "bootstrap_room": room}
    with pytest.raises(httpx.TimeoutException):
        _generate(decode.url, body, timeout=1.5)
    wait_for(lambda: decode.info()["disaggregation"]["transfers_waiting"] == 0, 20, "the decode leg to be dropped")
    wait_for(lambda: prefill.info()["disaggregation"]["outbox_early_cancels"] >= 1, 20, "the cancel to arrive")
    # The decode side cancelled the room: its prefill leg, arriving late, is aborted instead of run.
    r = _generate(prefill.url, body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["meta_info"]["finish_reason"]["type"] == "abort"
    # Through the router: the client disconnects after the first streamed token of a long generation.
    long_body = {"input_ids": mixed_prompts()[3], "sampling_params": {"temperature": 0, "max_new_tokens": 150,
                                                                  "ignore_eos": True}, "stream": True}
    with httpx.stream("POST", router.url + "/generate", json=long_body, timeout=60) as s:
        assert s.status_code == 200
        first = next(line for line in s.iter_lines() if line.startswith("data: "))
    assert len(httpx.Response(200, content=first[6:]).json()["output_ids"]) < 150
    assert_idle_and_free(decode)
    assert_idle_and_free(prefill, timeout_s=PREFILL_TIMEOUT_S + 10)


def test_state_nobody_fetches_is_dropped_after_timeout(pd):
    prefill, _, _, bport = pd
    body = {"input_ids": mixed_prompts()[4], "sampling_params": {"temperature": 0, "max_new_tokens": 8},
            "bootstrap_host": "127.0.0.1", "bootstrap_port": bport, "bootstrap_room": 777}
    r = _generate(prefill.url, body)
    assert r.status_code == 200, r.text
    assert r.json()["meta_info"]["completion_tokens"] == 1  # the prefill leg samples the first token only
    info = prefill.info()["disaggregation"]
    assert info["outbox_rooms"] == 1 and info["outbox_bytes"] > 0
    t0 = time.perf_counter()
    wait_for(lambda: prefill.info()["disaggregation"]["outbox_rooms"] == 0, PREFILL_TIMEOUT_S + 10,
             "the unfetched room to time out")
    record("pd", f"unfetched transfer state dropped {time.perf_counter() - t0:.1f} s after the prefill finished "
                 f"(--disaggregation-timeout {PREFILL_TIMEOUT_S:g})")
    assert_idle_and_free(prefill)


def test_decode_server_dies(pd):
    prefill, decode, router, bport = pd
    room = 5150
    body = {"input_ids": mixed_prompts()[7], "sampling_params": {"temperature": 0, "max_new_tokens": 8},
            "bootstrap_host": "127.0.0.1", "bootstrap_port": bport, "bootstrap_room": room}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(_generate, decode.url, body, 60)
        wait_for(lambda: decode.info()["disaggregation"]["transfers_waiting"] == 1, 20, "the decode leg to wait")
        decode.kill()
        with pytest.raises(httpx.HTTPError):
            waiting.result()
    # The prefill leg arrives after the decode server died: it runs, its transfer breaks or is never fetched,
    # and the prefill server frees everything and stays healthy.
    r = _generate(prefill.url, body, timeout=60)
    assert r.status_code == 200, r.text
    r = _generate(router.url, {"input_ids": mixed_prompts()[0], "sampling_params": {"max_new_tokens": 4}}, timeout=60)
    assert r.status_code >= 500, r.text
    assert_idle_and_free(prefill, timeout_s=PREFILL_TIMEOUT_S + 10)


def test_prefill_server_dies(pd, tmp_path):
    prefill, _, _, bport = pd
    decode2 = ServerProc.start(tmp_path, "decode2", [*SMALL, "--disaggregation-mode", "decode",
                                                     "--disaggregation-timeout", "60", "--skip-server-warmup"])
    try:
        body = {"input_ids": mixed_prompts()[1], "sampling_params": {"temperature": 0, "max_new_tokens": 8},
                "bootstrap_host": "127.0.0.1", "bootstrap_port": bport, "bootstrap_room": 9001}
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(_generate, decode2.url, body, 60)
            wait_for(lambda: decode2.info()["disaggregation"]["transfers_waiting"] == 1, 20, "the decode leg to wait")
            wait_for(lambda: prefill.info()["disaggregation"]["outbox_fetches_waiting"] == 1, 20,
                     "its receiver to wait at the bootstrap server")
            t0 = time.perf_counter()
            prefill.kill()
            r = waiting.result()
        assert r.status_code == 500, r.text
        assert "lost the prefill server" in r.text
        record("pd", f"prefill server killed: waiting decode request failed after {time.perf_counter() - t0:.2f} s")
        # A prefill server that is gone before the request: its refused connection fails the request once the
        # connect grace period (CONNECT_GRACE_S) has passed, not after the 60 s --disaggregation-timeout (a
        # timeout would say "timed out"). The message, not a wall-clock bound, shows which path failed it.
        t0 = time.perf_counter()
        r = _generate(decode2.url, {**body, "bootstrap_room": 9002}, timeout=60)
        assert r.status_code == 500 and "no prefill bootstrap server at" in r.text, r.text
        record("pd", f"prefill server gone before the request: refused after {time.perf_counter() - t0:.2f} s "
                     f"(connect grace {CONNECT_GRACE_S:g} s)")
        assert_idle_and_free(decode2)
    finally:
        decode2.stop()
