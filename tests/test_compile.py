"""The fixed program set (issue 12): no compilation while serving, programs from the persistent cache on
restart, and the bucket / sampler pieces it rests on.

Two real servers (`launch_server` subprocesses, small limits so the bucket set is small) share one
compilation cache directory: the first compiles (or loads) every program at startup and then serves a mixed workload
with `sglang:jit_compilations_total` unchanged; the second, started with the same flags, loads every
program from the cache. The sampler tests run the jitted functions on a small vocabulary.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from pd_harness import ServerProc, assert_idle_and_free, compile_cache_env

from sglang_tpu_qwen.engine.runner import greedy_screen, sampler
from sglang_tpu_qwen.engine.runner.buckets import BucketSet, StepBucket
from sglang_tpu_qwen.kernels.sampling_backend import SamplingBackend

CHUNK = 32
# 2 running requests, 32-token chunks, 128-token context: 7 forward buckets, 6 sampling programs.
FLAGS = ["--max-running-requests", "2", "--context-length", "128", "--chunked-prefill-size", str(CHUNK),
         "--max-prefill-tokens", "512", "--enable-metrics", "--constrained-json-disable-any-whitespace"]
NORMAL_IDS = 248044  # ordinary (non-special) ids of the Qwen3.5 vocabulary


def _ids(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, NORMAL_IDS, size=n).tolist()


def _compilations(url: str) -> int:
    text = httpx.get(url + "/metrics", timeout=30).text
    match = re.search(r"^sglang:jit_compilations_total ([0-9.e+]+)$", text, re.M)
    assert match, text
    return int(float(match.group(1)))


@pytest.fixture(scope="module")
def cache_dir() -> Path:
    """The machine's shared test compilation cache (pd_harness): a later run of this file loads what an earlier
    one compiled, so only the first run on a machine pays for compiling (the assertions hold either way)."""
    return Path(compile_cache_env()["JAX_COMPILATION_CACHE_DIR"])


@pytest.fixture(scope="module")
def first_server(cache_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    server = ServerProc.start(tmp_path_factory.mktemp("logs"), "first",
                              [*FLAGS, "--compilation-cache-dir", str(cache_dir)], timeout_s=600)
    try:
        yield server
    finally:
        server.stop()


def _mixed_workload(url: str) -> dict[str, Any]:
    """Every kind of request at once (threads); returns the replies by name. Raises on a non-200."""
    long_prompt = _ids(3 * CHUNK, 1)
    gen: dict[str, dict[str, Any]] = {
        **{f"len{n}": {"input_ids": _ids(n, n), "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
           for n in (1, CHUNK - 1, CHUNK + 1, 2 * CHUNK + 5, 3 * CHUNK)},
        "prefix_hit": {"input_ids": long_prompt, "sampling_params": {"max_new_tokens": 3, "temperature": 0}},
        "prefix_share": {"input_ids": long_prompt[:80] + _ids(9, 2), "sampling_params": {"max_new_tokens": 3}},
        "n3": {"text": "Count to ten:", "sampling_params": {"n": 3, "temperature": 0.8, "max_new_tokens": 5}},
        "logprobs": {"input_ids": _ids(40, 3), "return_logprob": True, "top_logprobs_num": 5,
                     "logprob_start_len": 0, "sampling_params": {"max_new_tokens": 4, "temperature": 0}},
        "penalties": {"text": "the the the the", "sampling_params": {
            "max_new_tokens": 6, "temperature": 0.7, "frequency_penalty": 0.5, "presence_penalty": 0.3,
            "repetition_penalty": 1.3}},
        "filters": {"text": "Once upon", "sampling_params": {
            "max_new_tokens": 6, "temperature": 1.0, "top_k": 5, "top_p": 0.8, "min_p": 0.05}},
        "wide_top_k": {"text": "Once upon", "sampling_params": {"max_new_tokens": 4, "top_k": 1000}},
        "stop": {"text": "Hello", "sampling_params": {"max_new_tokens": 12, "temperature": 0, "stop": ["e", "a"]}},
        "min_tokens": {"text": "Hi", "sampling_params": {"max_new_tokens": 4, "min_new_tokens": 4}},
        "regex": {"text": "A number:", "sampling_params": {"max_new_tokens": 6, "regex": "[0-9]{3}"}},
        "json": {"text": "JSON:", "sampling_params": {"max_new_tokens": 12, "json_schema": json.dumps(
            {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})}},
        "bias": {"text": "Hi", "sampling_params": {"max_new_tokens": 5, "temperature": 0.9,
                                                   "logit_bias": {"11": 100}}},
    }
    out: dict[str, Any] = {}

    def post(name: str, path: str, body: dict[str, Any]) -> None:
        r = httpx.post(url + path, json=body, timeout=300)
        assert r.status_code == 200, (name, r.text)
        out[name] = r.json()

    def stream(name: str) -> None:
        body = {"text": "Stream:", "stream": True, "sampling_params": {"max_new_tokens": 6, "temperature": 0}}
        with httpx.stream("POST", url + "/generate", json=body, timeout=300) as r:
            assert r.status_code == 200
            out[name] = [line for line in r.iter_lines() if line.startswith("data:")]

    def abort(name: str) -> None:
        body = {"input_ids": _ids(5, 4), "rid": "abort-me", "stream": True,
                "sampling_params": {"max_new_tokens": 100, "ignore_eos": True}}
        with httpx.stream("POST", url + "/generate", json=body, timeout=300) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data:"))
            assert httpx.post(url + "/abort_request", json={"rid": "abort-me"}, timeout=30).status_code == 200
            out[name] = [first, *(line for line in lines if line.startswith("data:"))]

    openai = {
        "completion_bias": ("/v1/completions", {"model": "default", "prompt": "Hi", "max_tokens": 4,
                                                "temperature": 0, "logit_bias": {"11": 100}}),
        "chat": ("/v1/chat/completions", {"model": "default", "max_tokens": 4, "top_logprobs": 3, "logprobs": True,
                                          "messages": [{"role": "user", "content": "Hello"}]}),
    }
    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(post, name, "/generate", body) for name, body in gen.items()]
        futures += [pool.submit(post, name, path, body) for name, (path, body) in openai.items()]
        futures += [pool.submit(stream, "stream"), pool.submit(abort, "abort")]
        for f in futures:
            f.result()
    return out


def test_mixed_workload_compiles_nothing(first_server: ServerProc) -> None:
    url = first_server.url
    info = first_server.info()
    stats = info["precompile"]
    assert stats["programs"] >= 7 + 6 and stats["compiled"] + stats["from_cache"] == stats["programs"]
    before = _compilations(url)
    assert before == info["jit_compilations"] >= stats["programs"]  # the counter and server_info agree
    out = _mixed_workload(url)
    _mixed_workload(url)  # again: prefix-cache hits on everything, other batch mixes
    assert _compilations(url) == before, "a request compiled a program after ready"
    assert first_server.info()["jit_compilations"] == before
    # The workload did what it asked for (a counter that stood still because nothing ran proves nothing).
    assert set(out["bias"]["output_ids"]) == {11}
    assert out["completion_bias"]["choices"][0]["text"] == out["bias"]["text"][: len(
        out["completion_bias"]["choices"][0]["text"])]
    assert re.fullmatch(r"[0-9]{0,3}", out["regex"]["text"]), out["regex"]["text"]
    assert len(out["n3"]) == 3 and len(out["logprobs"]["meta_info"]["output_top_logprobs"][0]) == 5
    assert out["min_tokens"]["meta_info"]["completion_tokens"] == 4
    assert any('"abort"' in line for line in out["abort"]), out["abort"][-3:]
    assert "after the server was ready" not in first_server.log.read_text()
    assert_idle_and_free(first_server)


@pytest.fixture(scope="module")
def mtp_server(cache_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    """The same flags with speculative decoding (SGLang's launch line) on the embedded model plus a random MTP
    layer (tests/mtp_checkpoint.py): the verify, commit, draft and verify-sampling programs join the set."""
    from mtp_checkpoint import build_mtp_checkpoint

    model = build_mtp_checkpoint(tmp_path_factory.mktemp("mtp"))
    server = ServerProc.start(tmp_path_factory.mktemp("logs"), "mtp", [
        *FLAGS, "--compilation-cache-dir", str(cache_dir), "--model-path", str(model),
        "--speculative-algorithm", "NEXTN", "--speculative-num-steps", "3", "--speculative-eagle-topk", "1",
        "--speculative-num-draft-tokens", "4"], timeout_s=600)
    try:
        yield server
    finally:
        server.stop()


def test_mixed_workload_with_mtp_compiles_nothing(mtp_server: ServerProc) -> None:
    url = mtp_server.url
    info = mtp_server.info()
    keys = info["precompile"]["programs"]
    assert keys > 7 + 6
    before = _compilations(url)
    out = _mixed_workload(url)
    _mixed_workload(url)
    assert _compilations(url) == before, "a request compiled a program after ready"
    state = mtp_server.info()["internal_states"][0]
    assert state["spec_verify_rows"] > 0 and state["avg_spec_accept_length"] >= 1.0
    metrics = httpx.get(url + "/metrics", timeout=30).text
    rows = re.search(r"^sglang:spec_verify_rows_total ([0-9.e+]+)$", metrics, re.M)
    assert rows and int(float(rows.group(1))) == state["spec_verify_rows"], metrics[-2000:]
    assert re.search(r"^sglang:spec_accept_length [0-9.e+]+$", metrics, re.M)
    assert set(out["bias"]["output_ids"]) == {11}
    assert re.fullmatch(r"[0-9]{0,3}", out["regex"]["text"]), out["regex"]["text"]
    assert "after the server was ready" not in mtp_server.log.read_text()
    assert_idle_and_free(mtp_server)


def test_restart_loads_every_program_from_the_cache(first_server: ServerProc, cache_dir: Path,
                                                    tmp_path_factory: pytest.TempPathFactory) -> None:
    first = first_server.info()["precompile"]
    first_server.stop()
    second = ServerProc.start(tmp_path_factory.mktemp("logs2"), "second",
                              [*FLAGS, "--compilation-cache-dir", str(cache_dir)], timeout_s=600)
    try:
        stats = second.info()["precompile"]
        assert stats["programs"] == first["programs"]
        assert stats["from_cache"] == stats["programs"] and stats["compiled"] == 0, stats
        assert f"({stats['programs']} from the persistent cache" in second.log.read_text()
    finally:
        second.stop()


# ---- pieces -----------------------------------------------------------------------------------------
def test_bucket_enumeration_and_mapping() -> None:
    b = BucketSet.build(max_running_requests=32, chunked_prefill_size=512, context_length=32768,
                        kv_tokens=65536, page_size=16)
    assert b.batch_sizes == (1, 4, 8, 16, 32) and b.token_sizes == (16, 64, 256, 512)
    assert b.pages == 2048 and all(x.pages == 2048 for x in b.step_buckets())
    assert all(x.batch * x.tokens <= 512 for x in b.step_buckets() if x.mode == "extend")
    # Per token size: one prompt alone, or a full step (no 2-row batch size: 256 tokens has one row only).
    # 5 decode + 6 extend programs.
    assert [b.extend_batches(t) for t in b.token_sizes] == [(1, 32), (1, 8), (1,), (1,)]
    assert len(b.step_buckets()) == 11
    assert b.decode_bucket(2) == StepBucket("decode", 4, 1, 2048)
    assert b.decode_bucket(5) == StepBucket("decode", 8, 1, 2048)
    assert b.extend_bucket(1, 100) == (StepBucket("extend", 1, 256, 2048), 100)
    assert b.extend_bucket(3, 100) == (StepBucket("extend", 8, 64, 2048), 64)
    # 8 rows of up to 100 tokens do not fit 512 padded tokens: the chunks are capped at 64 (split).
    assert b.extend_bucket(8, 100) == (StepBucket("extend", 8, 64, 2048), 64)
    assert b.extend_bucket(9, 100) == (StepBucket("extend", 32, 16, 2048), 16)
    small = BucketSet.build(max_running_requests=2, chunked_prefill_size=64, context_length=100, kv_tokens=64,
                            page_size=16)
    assert small.batch_sizes == (1, 2) and small.token_sizes == (16, 64)
    assert b.max_extend_rows == 32
    with pytest.raises(ValueError):
        b.extend_bucket(33, 1)
    dp = BucketSet.build(max_running_requests=8, chunked_prefill_size=64, context_length=100, kv_tokens=64,
                         page_size=16, dp=2, bs_paddings=[4, 1], token_paddings=[64, 16])
    assert dp.batch_sizes == (1, 4) and dp.token_sizes == (16, 64) and dp.pages == 4
    assert dp.decode_bucket(2) == StepBucket("decode", 8, 1, 4)
    with pytest.raises(ValueError, match="at least the running requests"):
        BucketSet.build(max_running_requests=8, chunked_prefill_size=64, context_length=100, kv_tokens=64,
                        page_size=16, bs_paddings=[4])


def _features(**on: bool) -> sampler.Features:
    return sampler.Features(*(jnp.asarray(on.get(f, False)) for f in sampler.Features._fields))


def _rows(b: int, v: int, **values: Any) -> sampler.RowParams:
    base = dict(temperature=np.ones(b, np.float32), top_p=np.ones(b, np.float32), top_k=np.zeros(b, np.int32),
                min_p=np.zeros(b, np.float32), seeds=np.arange(b, dtype=np.uint32), steps=np.zeros(b, np.int32),
                repetition=np.ones(b, np.float32), frequency=np.zeros(b, np.float32),
                presence=np.zeros(b, np.float32), penalty_table=np.zeros((b, v), np.int32),
                bias_ids=np.full((b, sampler.LOGIT_BIAS_WIDTH), -1, np.int32),
                bias_vals=np.zeros((b, sampler.LOGIT_BIAS_WIDTH), np.float32),
                ban_ids=np.full((b, sampler.BAN_WIDTH), -1, np.int32), bitmask=np.full((b, -(-v // 32)), -1, np.int32))
    base.update(values)
    return sampler.RowParams(**{k: jnp.asarray(x) for k, x in base.items()})


def test_sample_program_in_row_blocks_gives_the_same_rows_with_less_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """A "sample" batch larger than SAMPLE_BLOCK_ROWS runs block by block: every row's token and logprobs are
    the whole batch's (top-k, top-p, min-p, bias and logprobs on, per-row temperatures and seeds), and the
    compiled program's temporaries shrink with the block (XLA:CPU's memory analysis)."""
    from types import SimpleNamespace

    from sglang_tpu_qwen.engine.runner import programs

    b, v, h = 64, 4096, 32
    rng = np.random.default_rng(0)
    # Small integers: the products are exact in any summation order, so the two programs see the same logits.
    params = {"lm_head": jnp.asarray(rng.integers(-3, 4, size=(v, h)).astype(np.float32) / 4)}
    last = jnp.asarray(rng.integers(-3, 4, size=(b, h)).astype(np.float32) / 4)
    bias_ids = np.full((b, sampler.LOGIT_BIAS_WIDTH), -1, np.int32)
    bias_ids[::5, 0] = 7
    rp = _rows(b, v, temperature=rng.uniform(0.0, 1.5, b).astype(np.float32),
               top_k=rng.integers(0, 100, b).astype(np.int32), top_p=rng.uniform(0.5, 1.0, b).astype(np.float32),
               min_p=rng.uniform(0.0, 0.1, b).astype(np.float32), steps=rng.integers(0, 50, b).astype(np.int32),
               bias_ids=bias_ids, bias_vals=np.where(bias_ids >= 0, 5.0, 0.0).astype(np.float32))
    f = _features(top_k=True, top_k_large=True, top_p=True, min_p=True, bias=True, logprobs=True)
    config = SimpleNamespace(tie_word_embeddings=False)

    def run(block: int) -> tuple[tuple[np.ndarray, ...], int]:
        monkeypatch.setattr(programs, "SAMPLE_BLOCK_ROWS", block)
        fn = jax.jit(lambda p, x, r, ff: programs._sample_program(p, x, r, ff, config=config, kind="sample",
                                                                 sampling=SamplingBackend()))
        compiled = fn.lower(params, last, rp, f).compile()
        out = tuple(np.asarray(a) for a in compiled(params, last, rp, f))
        return out, compiled.memory_analysis().temp_size_in_bytes

    whole, whole_temp = run(b)
    blocked, blocked_temp = run(16)
    for a, c in zip(whole, blocked, strict=True):
        np.testing.assert_array_equal(a, c)
    assert len(set(whole[0].tolist())) > b // 4  # the rows sampled different tokens
    assert blocked_temp < whole_temp / 2, (blocked_temp, whole_temp)


def test_top_k_beyond_the_bound_keeps_exactly_k() -> None:
    v, b = 1000, 2
    logits = jax.random.normal(jax.random.PRNGKey(0), (b, v))
    top_k = np.array([100, 3], np.int32)  # 100 > TOP_K_BOUND: the bisection path
    assert top_k[0] > sampler.TOP_K_BOUND
    cut = sampler._top_k_cut(logits, jnp.asarray(top_k), jnp.asarray(True))
    kept = np.asarray(cut > sampler.NEG_INF).sum(axis=-1)
    assert kept.tolist() == [100, 3]
    order = np.argsort(-np.asarray(logits), axis=-1)
    assert set(np.flatnonzero(np.asarray(cut[0]) > sampler.NEG_INF)) == set(order[0, :100])


@pytest.mark.parametrize("v", [1000, 1024, 300])
def test_vocab_top_k_equals_lax_top_k_including_ties(v: int) -> None:
    b = 6
    # Integer-valued logits: many ties, within and across VOCAB_BLOCK-wide blocks.
    logits = jnp.floor(jax.random.normal(jax.random.PRNGKey(v), (b, v)) * 3)
    logits = logits.at[0].set(0.0).at[1, 5].set(99.0).at[1, v - 1].set(99.0)  # row 0 all tied
    for k in (1, 5, 20):
        vals, ids = sampler.vocab_top_k(logits, k)
        ref_vals, ref_ids = jax.lax.top_k(logits, k)
        assert np.array_equal(np.asarray(ids), np.asarray(ref_ids)), k
        assert np.array_equal(np.asarray(vals), np.asarray(ref_vals))
    assert np.asarray(sampler.greedy_ids(logits)).tolist()[:2] == [0, 5]  # lowest id on ties


def test_token_logprobs_match_a_float64_log_softmax() -> None:
    """Prompt logprobs (a target's raw logit minus raw_logprob_top's logsumexp, the sample program's
    formula) and the top 20 equal a float64 log_softmax within float32 rounding; ids as the sorted order."""
    logits = jax.random.normal(jax.random.PRNGKey(3), (4, 3000)) * 6
    targets = jnp.asarray([7, 0, 2999, 1234], jnp.int32)
    chosen, top, ids = sampler.token_logprobs(logits, targets, 20)
    ref = np.asarray(logits, np.float64)
    ref = ref - ref.max(axis=-1, keepdims=True)
    ref = ref - np.log(np.exp(ref).sum(axis=-1, keepdims=True))
    want_ids = np.argsort(-ref, axis=-1, kind="stable")[:, :20]
    assert np.array_equal(np.asarray(ids), want_ids)
    np.testing.assert_allclose(np.asarray(top), np.take_along_axis(ref, want_ids, axis=-1), rtol=0, atol=1e-5)
    np.testing.assert_allclose(np.asarray(chosen), ref[np.arange(4), np.asarray(targets)], rtol=0, atol=1e-5)
    assert np.all(np.asarray(chosen) <= 0)
    empty = sampler.token_logprobs(logits, targets, 0)
    assert empty[1].shape == (4, 0) and empty[2].shape == (4, 0)
    np.testing.assert_array_equal(np.asarray(empty[0]), np.asarray(chosen))


def test_top_p_floor_keeps_the_sorted_cumsum_nucleus() -> None:
    """Nucleus kept set (probs >= floor) equals the sorted-cumsum definition, on the top-K fast path (sharp
    rows, top_p = 1 rows) and on the bisection fallback (a flat row in the batch), and the two agree."""
    v = 5000
    logits = jax.random.normal(jax.random.PRNGKey(5), (4, v)) * jnp.asarray([[8.0], [6.0], [0.05], [8.0]])
    probs = jax.nn.softmax(logits, axis=-1)
    top_p = jnp.asarray([0.9, 0.5, 0.9, 1.0], jnp.float32)

    def reference(row: np.ndarray, p: float) -> np.ndarray:
        if p >= 1.0:
            return np.ones_like(row, bool)
        ordered = np.sort(row)[::-1]
        k = int(np.searchsorted(np.cumsum(ordered, dtype=np.float64), p))  # first rank with cum >= p
        return row >= ordered[k]

    top64 = np.sort(np.asarray(probs), axis=-1)[:, ::-1][:, :64].sum(axis=-1)
    assert top64[0] >= 0.9 and top64[1] >= 0.5 and top64[2] < 0.9  # rows 0, 1: fast path; row 2: bisection
    for rows in ([0, 1, 3], [0, 1, 2, 3]):  # without the flat row 2: fast path only; with it: fallback
        sub, ps = probs[jnp.asarray(rows)], top_p[jnp.asarray(rows)]
        floor = np.asarray(sampler._top_p_floor(sub, ps))
        kept = np.asarray(sub) >= floor[:, None]
        for i, r in enumerate(rows):
            assert np.array_equal(kept[i], reference(np.asarray(probs[r]), float(top_p[r]))), (rows, r)
        if 2 not in rows:
            assert float(floor[0]) > 0 and float(floor[-1]) == 0.0
    # The bisection agrees where top_p < 1 (at top_p = 1 it can drop ids below 1e-9 once the float32 mass of
    # the rest rounds to 1; the floor keeps every id there).
    bisect = np.asarray(sampler._top_p_bisect(probs, top_p))[:3]
    assert np.array_equal(np.asarray(probs)[:3] >= bisect[:, None],
                          np.asarray(probs)[:3] >= np.asarray(sampler._top_p_floor(probs, top_p))[:3, None])


def test_screened_greedy_equals_float32_argmax() -> None:
    v, h, b = 1000, 16, 64
    weight = jax.random.normal(jax.random.PRNGKey(3), (v, h)) * 0.5
    hidden = jax.random.normal(jax.random.PRNGKey(4), (b, h)) * 3
    screen = greedy_screen.greedy_screen(weight)
    blocks = -(-v // greedy_screen.SCREEN_BLOCK)
    assert screen.weight.dtype == jnp.bfloat16 and screen.norm.shape == screen.residual_norm.shape == (blocks,)
    full = hidden @ weight.T
    want = np.asarray(sampler.greedy_ids(full))
    got = np.asarray(greedy_screen.screened_greedy(hidden, weight, screen))
    assert np.array_equal(got, want)
    # An exact tie between ids 5 and 900 (different blocks): the lowest id wins.
    e = hidden[:1]
    top = jnp.sign(e[0]) * 10
    tied = weight.at[5].set(top).at[900].set(top)
    screen = greedy_screen.greedy_screen(tied)
    assert int(greedy_screen.screened_greedy(e, tied, screen)[0]) == 5


def test_inverse_cdf_matches_the_cumulative_definition() -> None:
    v = 300  # 3 blocks of VOCAB_BLOCK, the last one partial
    probs = np.zeros((4, v), np.float32)
    probs[:, [2, 130, 131, 299]] = [0.25, 0.25, 0.25, 0.25]  # exact binary fractions: no rounding
    u = np.array([0.0, 0.3, 0.5, 0.999999], np.float32)
    got = np.asarray(sampler._inverse_cdf(jnp.asarray(probs), jnp.asarray(u)))
    assert got.tolist() == [2, 130, 131, 299]
    # u * total rounding up to the total never lands past the last non-zero id.
    assert int(sampler._inverse_cdf(jnp.asarray(probs[:1]), jnp.asarray([1.0], jnp.float32))[0]) == 299


def test_logit_bias_bans_and_penalty_table() -> None:
    v, b = 300, 3
    logits = jnp.zeros((b, v)).at[:, 7].set(5.0)
    bias_ids = np.full((b, sampler.LOGIT_BIAS_WIDTH), -1, np.int32)
    bias_vals = np.zeros((b, sampler.LOGIT_BIAS_WIDTH), np.float32)
    bias_ids[0, :2], bias_vals[0, :2] = [42, 7], [100.0, -100.0]  # row 0: 42 forced, 7 suppressed
    ban_ids = np.full((b, sampler.BAN_WIDTH), -1, np.int32)
    ban_ids[1, 0] = 7  # row 1: the argmax is banned
    table = sampler.penalty_count(sampler.penalty_mark(jnp.zeros((b, v), jnp.int32),
                                                       jnp.asarray([[7, 9], [-1, -1], [7, -1]])),
                                  jnp.asarray([[7, -1], [-1, -1], [7, 7]]))
    assert np.asarray(table)[2, 7] == 1 + 2 * 2 and np.asarray(table)[0, 9] == 1
    rows = _rows(b, v, temperature=np.zeros(b, np.float32), bias_ids=bias_ids, bias_vals=bias_vals,
                 ban_ids=ban_ids, penalty_table=np.asarray(table), frequency=np.array([0, 0, 3.0], np.float32))
    processed = sampler.process_logits(logits, rows, _features(bias=True, penalty=True))
    tokens = np.asarray(sampler.greedy_ids(processed))
    assert tokens[0] == 42 and tokens[1] != 7 and tokens[2] != 7  # row 2: 5 - 3 * 2 < 0
    assert float(processed[2, 7]) == pytest.approx(5.0 - 6.0)
    same = sampler.process_logits(logits, _rows(b, v), _features())
    assert np.array_equal(np.asarray(same), np.asarray(logits))  # nothing to apply: untouched


def test_logit_bias_forces_the_token_and_is_validated(engine: Any, server: Any) -> None:
    out = engine.generate(prompt="Hello", sampling_params={"max_new_tokens": 4, "temperature": 1.0,
                                                           "logit_bias": {"123": 100.0}})
    assert out["output_ids"] == [123] * 4
    lowered = engine.generate(prompt="Hello", sampling_params={"max_new_tokens": 3, "temperature": 0})
    banned = engine.generate(prompt="Hello", sampling_params={
        "max_new_tokens": 3, "temperature": 0, "logit_bias": {str(lowered["output_ids"][0]): -100}})
    assert banned["output_ids"][0] != lowered["output_ids"][0]
    vocab = engine.model_config.vocab_size
    bad = [{"logit_bias": {str(vocab): 1.0}}, {"logit_bias": {"5": 100.5}}, {"logit_bias": {"x": 1}},
           {"logit_bias": {"-3": 1}}, {"logit_bias": {str(i): 1 for i in range(301)}}]
    for sp in bad:
        r = httpx.post(server.url + "/generate", json={"text": "hi", "sampling_params": sp}, timeout=60)
        assert r.status_code == 400, (sp, r.text)
    r = httpx.post(server.url + "/v1/completions", json={"model": "default", "prompt": "hi", "max_tokens": 2,
                                                         "logit_bias": {str(vocab + 1): 5}}, timeout=60)
    assert r.status_code == 400, r.text
    r = httpx.post(server.url + "/generate", json={"text": "hi", "return_logprob": True,
                                                   "top_logprobs_num": sampler.TOP_LOGPROBS_MAX + 1}, timeout=60)
    assert r.status_code == 400 and str(sampler.TOP_LOGPROBS_MAX) in r.text
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": "default", "max_tokens": 3, "temperature": 0, "logit_bias": {"123": 100},
        "messages": [{"role": "user", "content": "Hello"}]})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == engine.tokenizer.decode([123] * 3)

