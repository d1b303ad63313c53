"""Failure semantics (docs/internals.md, "Failures and health"), driven by the fault hook (engine/scheduler/faults.py).

A request the server fails is a 500 error object (non-streamed) or an error event then [DONE] (streamed);
a request whose step breaks is isolated and fails alone while the others finish with the tokens they
would have had; a loop failure outside a step is survived; /health is 503 before warm-up, while a step
outlives --watchdog-timeout and when the scheduler thread is dead. Every test ends with all pools free.
Durations never depend on the machine: a step that must be "in flight" is blocked on an event.
"""

from __future__ import annotations

import copy
import json
import threading
import time
from typing import Any

import httpx
import pytest
from conftest import serve_app

INNOCENT = {"input_ids": [11, 12, 13, 1], "sampling_params": {"max_new_tokens": 24, "ignore_eos": True,
                                                             "temperature": 0}}


def _idle_and_free(server, timeout_s: float = 120.0) -> dict:
    """Wait until nothing runs, flush the prefix cache, and return the memory usage (all must be free)."""
    deadline = time.monotonic() + timeout_s
    while True:
        info = httpx.get(server.url + "/get_server_info", timeout=30).json()
        if info["num_running"] == 0 and info["num_waiting"] == 0:
            httpx.post(server.url + "/flush_cache", timeout=60)
            mem = httpx.get(server.url + "/get_server_info", timeout=30).json()["memory"]
            if mem["kv_pages_free"] == mem["kv_pages_total"] and mem["gdn_slots_free"] == mem["gdn_slots_total"]:
                assert server.engine.grammar is None or server.engine.grammar.num_live_matchers == 0
                return mem
        assert time.monotonic() < deadline, f"not idle: {info}"
        time.sleep(0.05)


def _wait_for(pred, what: str, timeout_s: float = 120.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = pred()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def _running(engine, rid: str):
    return next((r for r in list(engine.scheduler.running) if r.rid == rid), None)


def _post_in_thread(url: str, path: str, body: dict, out: dict, key: str) -> threading.Thread:
    def run() -> None:
        out[key] = httpx.post(url + path, json=body, timeout=300)

    t = threading.Thread(target=run)
    t.start()
    return t


@pytest.fixture
def faults(server):
    inj = server.engine.scheduler.faults
    yield inj
    inj.disarm()


def test_bad_request_fails_alone_and_the_batch_goes_on(server, faults, caplog):
    """Issue 13 item 2: a request that breaks the sampler no longer takes its batch with it: the step of both
    fails, both rerun alone, the bad one fails again and alone, the innocent one finishes unchanged."""
    want = httpx.post(server.url + "/generate", json=INNOCENT, timeout=300).json()
    gate = threading.Event()
    faults.arm("forward", rid="innocent", skip=1, block=gate)  # hold the innocent at its first decode step
    faults.arm("sampler", rid="bad", skip=1, times=None)  # its prefill passes; any later step with it raises
    out: dict[str, httpx.Response] = {}
    t1 = _post_in_thread(server.url, "/generate", {**INNOCENT, "rid": "innocent"}, out, "innocent")
    _wait_for(lambda: server.engine.scheduler.health().step_started and _running(server.engine, "innocent"),
              "the innocent request's blocked step")
    t2 = _post_in_thread(server.url, "/generate", {"rid": "bad", "text": "hi", "sampling_params": {
        "max_new_tokens": 8, "ignore_eos": True, "temperature": 0}}, out, "bad")
    # The step is blocked, so the bad request waits in the inbox and joins the innocent's batch once released.
    _wait_for(lambda: server.engine.scheduler._inbox.qsize() > 0, "the bad request to arrive")
    gate.set()
    t1.join(300)
    t2.join(300)
    bad, innocent = out["bad"], out["innocent"]
    assert bad.status_code == 500, bad.text
    err = bad.json()["error"]
    assert err["code"] == 500 and err["type"] == "InternalServerError" and "injected fault" in err["message"]
    assert innocent.status_code == 200, innocent.text
    assert innocent.json()["output_ids"] == want["output_ids"]
    assert innocent.json()["meta_info"]["finish_reason"] == {"type": "length", "length": 24}
    failed = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step failed")]
    assert [m.split(":")[0] for m in failed] == ["step failed (2 requests)", "step failed (1 requests)"]
    assert "['innocent', 'bad']" in failed[0] and "['bad']" in failed[1]
    assert server.engine.health().problem(None) is None
    _idle_and_free(server)


def _sse(url: str, path: str, body: dict) -> tuple[int, list[Any]]:
    events: list[Any] = []
    with httpx.stream("POST", url + path, json=body, timeout=300) as r:
        if r.status_code != 200:
            r.read()
            return r.status_code, [r.json()]
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append("[DONE]" if line == "data: [DONE]" else json.loads(line[6:]))
    return 200, events


def test_failed_requests_are_500s_and_stream_error_events(server, faults):
    """Issue 13 items 1 and 3: a request failed by the server never looks like a finished generation."""
    gen = {"text": "hi", "sampling_params": {"max_new_tokens": 6, "ignore_eos": True, "temperature": 0}}
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "temperature": 0, "ignore_eos": True}

    faults.arm("forward", rid="f-gen")
    r = httpx.post(server.url + "/generate", json={**gen, "rid": "f-gen"}, timeout=300)
    assert r.status_code == 500 and r.json()["error"]["type"] == "InternalServerError", r.text

    faults.arm("sampler", rid="f-chat")
    r = httpx.post(server.url + "/v1/chat/completions", json={**chat, "rid": "f-chat"}, timeout=300)
    assert r.status_code == 500, r.text
    assert r.json()["object"] == "error" and r.json()["code"] == 500 and "injected fault" in r.json()["message"]

    faults.arm("forward", rid="f-sgen", skip=2)  # two chunks go out, then the step fails
    status, events = _sse(server.url, "/generate", {**gen, "rid": "f-sgen", "stream": True})
    assert status == 200 and events[-1] == "[DONE]"
    assert len(events) >= 3 and all("text" in e for e in events[:-2])
    assert events[-2]["error"]["code"] == 500 and "injected fault" in events[-2]["error"]["message"]

    faults.arm("sampler", rid="f-schat", skip=2)
    status, events = _sse(server.url, "/v1/chat/completions", {**chat, "rid": "f-schat", "stream": True})
    assert status == 200 and events[-1] == "[DONE]"
    assert events[-2]["error"]["object"] == "error" and events[-2]["error"]["code"] == 500
    assert all(c["choices"][0]["finish_reason"] is None for c in events[:-2] if c.get("choices"))

    faults.arm("forward", rid="f-first")  # fails before the first chunk: still a plain 500
    status, body = _sse(server.url, "/generate", {**gen, "rid": "f-first", "stream": True})
    assert status == 500 and body[0]["error"]["code"] == 500
    assert server.engine.health().problem(None) is None
    _idle_and_free(server)


def test_loop_failure_outside_the_step_is_survived(server, faults):
    faults.arm("loop", times=2)  # below the fatal count (MAX_LOOP_FAILURES in a row)
    r = httpx.post(server.url + "/generate", json=INNOCENT, timeout=300)
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 24
    snap = server.engine.health()
    assert snap.alive and snap.fatal_error is None and "injected fault at loop" in (snap.last_error or "")
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200
    _idle_and_free(server)


def test_ignore_eos_disables_stop_token_ids(server):
    """Issue 13 item 10, SGLang's rule: with ignore_eos, stop_token_ids do not stop either."""
    ref = httpx.post(server.url + "/generate", json=INNOCENT, timeout=300).json()["output_ids"]
    body = {**INNOCENT, "sampling_params": {**INNOCENT["sampling_params"], "stop_token_ids": [ref[1]]}}
    assert httpx.post(server.url + "/generate", json=body, timeout=300).json()["output_ids"] == ref
    body["sampling_params"]["ignore_eos"] = False
    stopped = httpx.post(server.url + "/generate", json=body, timeout=300).json()
    assert stopped["output_ids"][-1] == ref[1] and len(stopped["output_ids"]) <= 2


def test_health_is_503_before_warm_up_and_during_a_stalled_step(server, faults):
    eng = server.engine
    eng.set_warmed_up(False)
    try:
        r = httpx.get(server.url + "/health", timeout=30)
        assert r.status_code == 503 and "warm-up" in r.text
    finally:
        eng.set_warmed_up(True)
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200

    gate = threading.Event()
    faults.arm("forward", rid="stall", block=gate)
    args = eng.server_args
    saved, args.watchdog_timeout = args.watchdog_timeout, 0.2
    out: dict[str, httpx.Response] = {}
    try:
        t = _post_in_thread(server.url, "/generate", {**INNOCENT, "rid": "stall"}, out, "stall")
        started = _wait_for(lambda: eng.scheduler.health().step_started, "the stalled step")
        _wait_for(lambda: time.monotonic() - started > 0.3, "the watchdog timeout to pass", 30)
        r = httpx.get(server.url + "/health", timeout=30)
        assert r.status_code == 503 and "watchdog-timeout" in r.text
    finally:
        gate.set()
        args.watchdog_timeout = saved
    t.join(300)
    assert out["stall"].status_code == 200
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200
    _idle_and_free(server)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the thread dies on purpose
def test_dead_scheduler_thread_is_unhealthy_and_refuses(server):
    """A scheduler thread that dies (here: a BaseException out of its loop) makes /health 503 and new requests
    503 at once, instead of hanging. Runs on a second scheduler over the same model (no step ever runs)."""
    from sglang_tpu_qwen.engine.scheduler.scheduler import Scheduler
    from sglang_tpu_qwen.server.app import create_app

    eng = server.engine
    sched = Scheduler(eng.runner, eng.tokenizer, eng.server_args, eng.context_length)
    sched.faults.arm("loop", kill_thread=True)
    sched.start()
    sched._thread.join(60)
    assert not sched._thread.is_alive()
    dead = copy.copy(eng)
    dead.scheduler = sched
    with serve_app(create_app(dead)) as url:
        r = httpx.get(url + "/health", timeout=30)
        assert r.status_code == 503 and "not running" in r.text
        r = httpx.post(url + "/generate", json=INNOCENT, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["type"] == "ServiceUnavailable"
        r = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1}, timeout=30)
        assert r.status_code == 503 and r.json()["code"] == 503
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200  # the real one is untouched


def test_max_prefill_tokens_bounds_each_step(server):
    """--max-prefill-tokens limits the prompt tokens of every prefill step (the smaller of it and
    --chunked-prefill-size); a longer prompt is chunked, with the same output."""
    eng = server.engine
    body = {"input_ids": list(range(100, 140)), "sampling_params": {"max_new_tokens": 3, "temperature": 0}}
    httpx.post(server.url + "/flush_cache", timeout=60)
    want = httpx.post(server.url + "/generate", json=body, timeout=300).json()["output_ids"]
    httpx.post(server.url + "/flush_cache", timeout=60)
    sizes: list[int] = []
    forward = eng.runner.forward

    def recording_forward(batch):
        sizes.append(int(sum(batch.extend_lens)))  # the tokens this step feeds
        return forward(batch)

    saved = eng.server_args.max_prefill_tokens
    eng.server_args.max_prefill_tokens = 16
    eng.runner.forward = recording_forward
    try:
        got = httpx.post(server.url + "/generate", json=body, timeout=300).json()["output_ids"]
    finally:
        eng.runner.forward = forward
        eng.server_args.max_prefill_tokens = saved
    assert got == want
    assert sizes[:3] == [16, 16, 8] and max(sizes) <= 16
    _idle_and_free(server)
