"""Scale-out: 2 replica servers behind the real `smg` router. A multi-turn workload (bench_serving's own dataset and
client) computes fewer prefill tokens with cache-aware routing than with round robin, and every reply is the
single server's greedy reply.

Deterministic by construction: turns are sent one at a time (--max-concurrency 1), so routing never depends on
timing. Three sessions over two replicas: round robin moves each session to the other replica on every turn
(whose cache holds only the turn before last), cache-aware routing keeps a session where its history is.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from conftest import free_port, record
from pd_harness import SMALL, ServerProc, smg_binary, wait_for

from sglang_tpu_qwen.bench import serving

WORKLOAD = ["--dataset-name", "multi-turn", "--mt-num-sessions", "3", "--mt-num-turns", "3",
            "--mt-system-prompt-len", "32", "--mt-turn-input-len", "16", "--mt-turn-output-len", "8",
            "--max-concurrency", "1", "--seed", "5", "--disable-tqdm"]


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    logs = tmp_path_factory.mktemp("replicas")
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        # --disable-precompile: the workload needs a few step shapes; compiling all of them would dominate the test.
        args = [*SMALL, "--enable-metrics", "--disable-precompile"]
        futures = [pool.submit(ServerProc.start, logs, f"replica{i}", args) for i in range(2)]
        servers = [f.result() for f in futures]
    try:
        yield logs, servers
    finally:
        for s in servers:
            s.stop()


def _router(logs: Path, servers: list[ServerProc], policy: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [smg_binary(), "launch", "--worker-urls", *[s.url for s in servers], "--policy", policy,
           "--host", "127.0.0.1", "--port", str(port), "--log-level", "warn", "--disable-retries",
           "--shutdown-grace-period-secs", "0",
           # smg's own metrics listener defaults to 0.0.0.0:29000: a second router on the machine would collide.
           "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
    with open(logs / f"router_{policy}.log", "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        if proc.poll() is not None:
            raise RuntimeError((logs / f"router_{policy}.log").read_text()[-2000:])
        try:
            return len(httpx.get(url + "/workers", timeout=5).json().get("workers", [])) == len(servers)
        except (httpx.HTTPError, ValueError):
            return False

    wait_for(ready, 60, f"smg ({policy}) to register both workers", interval=0.3)
    return proc, url


def _run(url: str) -> tuple[dict, list[serving.RequestResult]]:
    args = serving.parse_args(["--base-url", url, *WORKLOAD])
    sessions = serving.build_sessions(args)
    results, duration = asyncio.run(serving.run(args, sessions))
    return serving.summarize(results, duration, sum(len(s) for s in sessions)), results


def test_cache_aware_computes_less_prefill_and_replies_match(replicas):
    logs, servers = replicas
    runs = {}
    for policy in ("round_robin", "cache_aware"):
        for s in servers:  # both policies start from empty caches
            assert httpx.post(s.url + "/flush_cache", timeout=30).status_code == 200
        hits0 = [s.info()["memory"]["cache_hit_tokens"] for s in servers]
        proc, url = _router(logs, servers, policy)
        try:
            t0 = time.perf_counter()
            metrics, results = _run(url)
            elapsed = time.perf_counter() - t0
        finally:
            proc.kill()
            proc.wait(timeout=30)
        assert metrics["completed"] == 9 and metrics["failed"] == 0, metrics["errors"]
        per_replica = [s.info()["memory"]["cache_hit_tokens"] - hits0[i] for i, s in enumerate(servers)]
        runs[policy] = metrics, results
        record("replicas", f"2 replicas via smg {policy}: prompt {metrics['total_input_tokens']} tokens, prefill "
                           f"computed {metrics['prefill_tokens_computed']}, cached per replica {per_replica}, "
                           f"TTFT p50 {metrics['median_ttft_ms']:.0f} ms, {elapsed:.1f} s")
    rr, ca = runs["round_robin"][0], runs["cache_aware"][0]
    assert rr["total_input_tokens"] == ca["total_input_tokens"]  # same conversations: replies are greedy
    # Every later turn of a session finds its whole history on its replica with cache-aware routing; with
    # round robin it finds only the turn before last.
    assert ca["prefill_tokens_computed"] < rr["prefill_tokens_computed"]
    # A single server's replies to the distinct prompts (both runs send the same ones): replica 0 asked directly,
    # its prefix cache emptied before each, so every prompt is prefilled whole, without any routing or reuse.
    got = {tuple(r.prompt): r.output_ids for _, results in runs.values() for r in results}
    assert len(got) == 9
    single = servers[0].url
    for p, out in got.items():
        assert httpx.post(single + "/flush_cache", timeout=30).status_code == 200
        r = httpx.post(single + "/generate", timeout=120, json={
            "input_ids": list(p), "sampling_params": {"temperature": 0, "ignore_eos": True, "max_new_tokens": 8}})
        assert r.status_code == 200, r.text
        assert r.json()["meta_info"]["cached_tokens"] == 0
        assert out == r.json()["output_ids"], f"prompt of {len(p)} tokens"
    for _, results in runs.values():
        for r in results:
            assert r.output_ids == got[tuple(r.prompt)]
