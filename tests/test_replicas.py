"""Scale-out: 2 replica servers with default flags behind the real `smg` router, cache-aware with the settings
launch/replicas.sh uses (launch/smg_cache_aware.args). A multi-turn workload (bench_serving's own dataset and
client) computes fewer prefill tokens with cache-aware routing than with round robin, and every reply is the
single server's greedy reply.

Deterministic routing with requests in flight together: five sessions share a system prompt and run in lock-step
(--mt-lockstep: turn k of every session goes out together once turn k - 1 of all has finished). Default server
flags (64 GDN snapshot slots per replica: one replica holds every session's history). Cache-aware
routing sends every request to the replica holding the system prompt and then the session's history (five in
flight stay under the spill margin), whatever their order. Round robin deals a wave of five over two replicas,
so from one wave to the next at least one session changes replica, whatever the order, and prefills its history
again on a replica that holds only its system prompt.
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
from pd_harness import ServerProc, cache_aware_args, smg_binary, wait_for

from sglang_tpu_qwen.bench import serving

SESSIONS, TURNS = 5, 3
WORKLOAD = ["--dataset-name", "multi-turn", "--mt-num-sessions", str(SESSIONS), "--mt-num-turns", str(TURNS),
            "--mt-system-prompt-len", "64", "--mt-turn-input-len", "16", "--mt-turn-output-len", "8",
            "--max-concurrency", str(SESSIONS), "--mt-lockstep", "--seed", "5", "--disable-tqdm"]


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    logs = tmp_path_factory.mktemp("replicas")
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        # Default server flags. --disable-precompile only defers compilation to first use: the workload needs a
        # few step shapes, and compiling the whole program set would dominate the test.
        args = ["--enable-metrics", "--disable-precompile"]
        futures = [pool.submit(ServerProc.start, logs, f"replica{i}", args) for i in range(2)]
        servers = [f.result() for f in futures]
    try:
        yield logs, servers
    finally:
        for s in servers:
            s.stop()


def _router(logs: Path, servers: list[ServerProc], policy: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    extra = cache_aware_args() if policy == "cache_aware" else []
    cmd = [smg_binary(), "launch", "--worker-urls", *[s.url for s in servers], "--policy", policy, *extra,
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
        assert metrics["completed"] == SESSIONS * TURNS and metrics["failed"] == 0, metrics["errors"]
        per_replica = [s.info()["memory"]["cache_hit_tokens"] - hits0[i] for i, s in enumerate(servers)]
        runs[policy] = metrics, results
        record("replicas", f"2 replicas via smg {policy}: prompt {metrics['total_input_tokens']} tokens, prefill "
                           f"computed {metrics['prefill_tokens_computed']}, cached per replica {per_replica}, "
                           f"TTFT p50 {metrics['median_ttft_ms']:.0f} ms, {elapsed:.1f} s")
    rr, ca = runs["round_robin"][0], runs["cache_aware"][0]
    assert rr["total_input_tokens"] == ca["total_input_tokens"]  # same conversations: replies are greedy
    # Every later turn of a session finds its whole history on its replica with cache-aware routing; with
    # round robin a session that changed replica finds only the system prompt or the turn before last. Compared
    # over the later waves: how often the first wave's five copies of the system prompt are prefilled depends on
    # how the replica's steps batch requests arriving together, under either policy.
    later = {}
    for policy, (_, results) in runs.items():
        assert all(r.prompt_len == 64 + 16 for r in results[:SESSIONS])  # lock-step: the first wave first
        later[policy] = sum(r.prompt_len - r.cached_tokens for r in results[SESSIONS:])
    record("replicas", f"prefill computed after the first wave: round_robin {later['round_robin']}, "
                       f"cache_aware {later['cache_aware']}")
    assert later["cache_aware"] < later["round_robin"]
    # A single server's replies to the distinct prompts (both runs send the same ones): replica 0 asked directly,
    # its prefix cache emptied before each, so every prompt is prefilled whole, without any routing or reuse.
    got = {tuple(r.prompt): r.output_ids for _, results in runs.values() for r in results}
    assert len(got) == SESSIONS * TURNS
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
