"""Failures a whole server process must report (launch_server subprocesses, faults from the environment).

- A warm-up request that fails stops the server: the process exits non-zero with the cause.
- A step that fails after consuming the donated device cache makes the server unhealthy: the step's
  requests get a 500, /health and /health_generate a 503 naming the cause, and new requests a 503 at once.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
from conftest import free_port
from pd_harness import compile_cache_env

from sglang_tpu_qwen.engine.scheduler.faults import ENV

SMALL = ["--max-running-requests", "4", "--context-length", "256", "--chunked-prefill-size", "256",
         "--grammar-backend", "none", "--disable-radix-cache", "--log-level", "info"]


def _launch(port: int, fault: str, *extra: str) -> subprocess.Popen:
    env = dict(os.environ, **compile_cache_env(), **{ENV: fault})
    return subprocess.Popen([sys.executable, "-m", "sglang_tpu_qwen.launch_server", "--host", "127.0.0.1",
                             "--port", str(port), *SMALL, *extra], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def test_failed_warm_up_exits_non_zero_with_the_cause():
    proc = _launch(free_port(), "forward@0")  # the first step (the warm-up's) raises
    try:
        out, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, out[-3000:]
    assert "Warm-up failed: HTTP 500" in out and "injected fault at forward" in out, out[-3000:]
    assert "ready to roll" not in out


def test_cache_consumed_by_a_failed_step_makes_the_server_unhealthy():
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = _launch(port, "forward@rid=doom:consume", "--skip-server-warmup")
    try:
        deadline = time.monotonic() + 600
        while True:
            assert proc.poll() is None, proc.stdout.read()[-3000:]
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.2)
        ok = httpx.post(url + "/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}}, timeout=300)
        assert ok.status_code == 200, ok.text
        # Two sequences in one step; the forward consumes the donated cache, then raises.
        r = httpx.post(url + "/generate", timeout=300, json={"text": ["a b", "c d"], "rid": ["doom", "other"],
                                                             "sampling_params": {"max_new_tokens": 4}})
        assert r.status_code == 500 and "device cache is not intact" in r.json()["error"]["message"], r.text
        for path in ("/health", "/health_generate"):
            h = httpx.get(url + path, timeout=30)
            assert h.status_code == 503 and "device cache is not intact" in h.text, (path, h.text)
        r = httpx.post(url + "/generate", json={"text": "hi"}, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["type"] == "ServiceUnavailable", r.text
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
