"""Prefill/decode disaggregation in one process (`--disaggregation-mode colocated-split`) behind `smg`.

One launch_server subprocess on 8 emulated CPU devices serves a prefill engine on devices 0-3 and a decode
engine on devices 4-7 (each a dp 4 / ep 4 mesh), each on its own HTTP port; request state moves with
`jax.device_put` (the in-process backend). Both engines serve the low-precision caches, FP8 KV pages
(--kv-cache-dtype fp8_e4m3: the transfer carries float8_e4m3fn pages) and a bfloat16 GDN state
(--mamba-ssm-dtype bfloat16): outputs must equal the colocated single-device engine of conftest with the
same caches (engine_bf16), up to near-ties (a bf16 state is rounded where each prefill chunk ends, and
concurrent chunks end where the step budget falls), both when a request misses the prefix cache and when
it hits. float32 state and auto pages go through PD in test_pd_tcp.py.
"""

from __future__ import annotations

import concurrent.futures
import time

import httpx
import pytest
from conftest import BF16_TIE_MARGIN, first_divergence_is_a_tie, free_port, record
from pd_harness import SMALL, RouterProc, ServerProc, assert_idle_and_free, mixed_prompts

XLA_8_DEVICES = ("--xla_force_host_platform_device_count=8 --xla_cpu_use_xnnpack=false "
                 "--xla_cpu_enable_concurrency_optimized_scheduler=false")


@pytest.fixture(scope="module")
def split(tmp_path_factory):
    """(prefill view, decode view, router) of one colocated-split server."""
    logs = tmp_path_factory.mktemp("pd_inprocess")
    bport, dport = free_port(), free_port()
    # Each engine: data-parallel attention over its 4 devices, experts split 4 ways (docs/internals.md, "parallel/").
    # --chunked-prefill-size is split over the DP ranks (SGLang's rule): 256 keeps SMALL's 64 tokens per rank.
    # --max-total-tokens: a rank's KV pool (XLA:CPU's default is 65,536 tokens, whose size each step's cost grows
    # with); at 2,048 the ratio rule leaves no GDN snapshot slot (0.39 MiB each in bfloat16), so 16 a rank are
    # asked for the prefix-cache hits.
    server = ServerProc.start(logs, "split", [*SMALL, "--dp-size", "4", "--ep-size", "4", "--max-total-tokens", "2048",
                                              "--max-gdn-snapshots", "16",
                                              "--chunked-prefill-size", "256", "--kv-cache-dtype", "fp8_e4m3",
                                              "--mamba-ssm-dtype", "bfloat16",
                                              "--disaggregation-mode", "colocated-split",
                                              "--disaggregation-prefill-devices", "4",
                                              "--disaggregation-decode-port", str(dport),
                                              "--disaggregation-bootstrap-port", str(bport)],
                              env={"XLA_FLAGS": XLA_8_DEVICES})
    decode = ServerProc(f"http://127.0.0.1:{dport}", dport, server.log, server.proc)
    router = None
    try:
        router = RouterProc.start(logs, server, bport, decode)
        yield server, decode, router
    finally:
        if router is not None:
            router.stop()
        server.stop()


def test_split_4_4_matches_colocated(split, engine_bf16):
    prefill, decode, router = split
    engine = engine_bf16
    p_info, d_info = prefill.info()["disaggregation"], decode.info()["disaggregation"]
    assert p_info["mode"] == "prefill" and d_info["mode"] == "decode"
    assert p_info["transfer_backend"] == d_info["transfer_backend"] == "inprocess"
    # Device ids: each engine's mesh spans its own group of the 8.
    assert p_info["devices"] == [0, 1, 2, 3] and d_info["devices"] == [4, 5, 6, 7], (p_info, d_info)

    for info in (prefill.info(), decode.info(), engine.get_server_info()):
        assert info["kv_cache_dtype"] == "fp8_e4m3" and info["mamba_ssm_dtype"] == "bfloat16"
        assert {u["kv_cache_dtype"] for u in (x["memory_usage"] for x in info["internal_states"])} == {
            "float8_e4m3fn"}

    prompts = mixed_prompts()
    sp = [{"temperature": 0, "max_new_tokens": 8 + 4 * (i % 3)} for i in range(len(prompts))]
    want = []
    for p, s in zip(prompts, sp, strict=True):  # a prefix-cache miss, then the same request hitting it
        assert engine.flush_cache()
        want.append(engine.generate(input_ids=p, sampling_params=s, return_logprob=True,
                                    top_logprobs_num=2)["meta_info"])
        hit = engine.generate(input_ids=p, sampling_params=s)
        first_divergence_is_a_tie(hit["output_ids"], want[-1], BF16_TIE_MARGIN)
        assert hit["meta_info"]["cached_tokens"] > 0 or len(p) < 64
    before = d_info["transfers_done"]
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        replies = list(pool.map(lambda a: httpx.post(router.url + "/generate", timeout=300,
                                                     json={"input_ids": a[0], "sampling_params": a[1]}),
                                zip(prompts, sp, strict=True)))
    elapsed = time.perf_counter() - t0
    for r in replies:
        assert r.status_code == 200, r.text
    agree = [first_divergence_is_a_tie(r.json()["output_ids"], m, BF16_TIE_MARGIN)
             for r, m in zip(replies, want, strict=True)]
    exact = sum(a == len(m["output_token_logprobs"]) for a, m in zip(agree, want, strict=True))
    assert decode.info()["disaggregation"]["transfers_done"] - before == len(prompts)
    # Through PD, long prompts sent twice in a row: the second hits the prefill server's prefix cache (its
    # snapshot budget is small, so right after the first) and gives the colocated miss's tokens.
    for i in (3, 6, 7):
        for _ in range(2):
            r = httpx.post(router.url + "/generate", timeout=300, json={"input_ids": prompts[i],
                                                                        "sampling_params": sp[i]})
            assert r.status_code == 200, r.text
            first_divergence_is_a_tie(r.json()["output_ids"], want[i], BF16_TIE_MARGIN)
        assert r.json()["meta_info"]["cached_tokens"] > 0, r.json()["meta_info"]
    record("pd", f"in-process PD (colocated-split, 8 emulated devices 4/4, dp4 ep4 meshes, FP8 KV pages, bf16 "
                 f"GDN state) via smg: 8 concurrent prompts, {exact} of {len(prompts)} token-identical to colocated "
                 f"(the rest diverge at a near-tie, < {BF16_TIE_MARGIN} nats), misses and prefix-cache hits, "
                 f"{elapsed:.1f} s")
    assert_idle_and_free(prefill)
    assert_idle_and_free(decode)
