"""The in-process Engine on the chip: Pallas kernels == reference backends, cache hit == miss, chunked prefill ==
whole prefill, and no compilation after ready.

The embedded model (attention head_dim 128, GDN head dims 128: the kernels' TPU tiling) at float32, greedy, every
request running its full length. One engine at a time: the reference engines run first and are shut down (module
fixture ``expected``); then the served engine (Pallas kernels, 64-token chunks, every program precompiled as a
server does) answers every test of the module.

Matmul precision: XLA:TPU computes a float32 matrix product at its default precision in one bfloat16 pass (about
three significant digits), while the kernels compute float32 products in full. At the default, the reference
backends' attention and GDN would then differ from the kernels by ~1e-3, enough to flip a greedy choice between
two close logits now and then, which is a statement about the reference, not the kernels. So this module sets
``jax_default_matmul_precision`` to ``highest`` for its engines (every program compiled in it): the two backends
then compute the same float32 function, and the tokens must agree exactly. The prefix-cache and chunking tests
compare one backend with itself and would hold at either precision.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import jax
import pytest

from sglang_tpu_qwen.engine.runner import compilation

from .suite import (
    ENGINE_KWARGS,
    GREEDY,
    PALLAS,
    REFERENCE,
    assert_memory_back,
    highest_precision,
    ids,
    output_ids,
    running_engine,
)

CHUNK = 64  # the served engine's --chunked-prefill-size
WHOLE = 512  # a chunk size that holds every prompt here whole
# Prompt lengths 1 to 150 in one batch: with 64-token chunks the extend steps hold ragged rows (1 to 64 tokens),
# the long prompt prefills in chunks that continue its cached prefix across page boundaries; then all four decode.
PROMPTS = [ids(1, 1), ids(2, 9), ids(3, 40), ids(4, 150)]
LONG = ids(5, 300)  # five 64-token chunks, or one step
# A prompt sharing PROMPTS[3]'s first 100 tokens, then its own.
BRANCH = PROMPTS[3][:100] + ids(6, 30)


@pytest.fixture(scope="module", autouse=True)
def _highest_precision() -> Iterator[None]:
    """Float32 matrix products in full for every program this module compiles (module docstring)."""
    with highest_precision():
        yield


@pytest.fixture(scope="module")
def expected() -> dict[str, Any]:
    """The replies every test compares with, from engines that are shut down before the served one starts:
    the reference backends with the cache off and every prompt prefilled whole ("reference"), and the Pallas
    kernels prefilling LONG whole ("whole")."""
    out: dict[str, Any] = {}
    with running_engine(**ENGINE_KWARGS, **REFERENCE, chunked_prefill_size=WHOLE, disable_radix_cache=True,
                        disable_precompile=True) as ref:
        assert (ref.runner.backends.attention.name, ref.runner.backends.gdn.name) == ("reference", "reference")
        out["prompts"] = output_ids(ref.generate(input_ids=PROMPTS, sampling_params=GREEDY))
        out["long"] = output_ids(ref.generate(input_ids=LONG, sampling_params=GREEDY))[0]
        out["branch"] = output_ids(ref.generate(input_ids=BRANCH, sampling_params=GREEDY))[0]
        # The next turn of PROMPTS[3]: the prompt, its reply, a new message.
        out["turn2"] = PROMPTS[3] + out["prompts"][3] + ids(7, 12)
        out["turn2_ids"] = output_ids(ref.generate(input_ids=out["turn2"], sampling_params=GREEDY))[0]
    with running_engine(**ENGINE_KWARGS, **PALLAS, chunked_prefill_size=WHOLE, disable_radix_cache=True,
                        disable_precompile=True) as whole:
        out["long_whole"] = output_ids(whole.generate(input_ids=LONG, sampling_params=GREEDY))[0]
    return out


@pytest.fixture(scope="module")
def served(expected: dict[str, Any]) -> Iterator[Any]:
    """The engine under test: Pallas kernels, prefix cache on, 64-token chunks, precompiled. (It takes
    ``expected`` so that the reference engines have run and are gone before it starts.)"""
    with running_engine(**ENGINE_KWARGS, **PALLAS, chunked_prefill_size=CHUNK) as eng:
        backends = eng.runner.backends
        assert (backends.attention.name, backends.gdn.name) == ("pallas", "pallas")
        assert backends.interpret == (jax.default_backend() != "tpu")  # on the chip: compiled by Mosaic
        yield eng
        assert_memory_back(eng)


def _generate(eng: Any, prompt: list[int] | list[list[int]]) -> list[dict]:
    """Greedy replies of ``eng`` to one prompt or a batch (always a list)."""
    replies = eng.generate(input_ids=prompt, sampling_params=GREEDY)
    return replies if isinstance(replies, list) else [replies]


def test_pallas_kernels_give_reference_greedy_ids(expected: dict[str, Any], served: Any) -> None:
    """A batch of four prompts (1-150 tokens: ragged extend steps, continuing chunks, batched decodes) through
    the kernels: the reference backends' tokens, token for token."""
    assert served.flush_cache()
    got = output_ids(_generate(served, PROMPTS))
    assert all(len(g) == GREEDY["max_new_tokens"] for g in got)
    assert got == expected["prompts"]


def test_prefix_cache_hit_gives_miss_ids(expected: dict[str, Any], served: Any) -> None:
    """The same prompt twice: the second is served from the cache (KV pages + GDN snapshot) with the first's
    tokens, which are the cache-off reference's; so are a branch off its prefix and its next turn."""
    assert served.flush_cache()
    prompt, want = PROMPTS[3], expected["prompts"][3]
    miss, hit = _generate(served, prompt)[0], _generate(served, prompt)[0]
    assert miss["meta_info"]["cached_tokens"] == 0
    # The snapshot at the prompt's last page boundary before its final token.
    assert hit["meta_info"]["cached_tokens"] >= 16 * ((len(prompt) - 1) // 16), hit["meta_info"]
    assert miss["output_ids"] == want
    assert hit["output_ids"] == want
    branch = _generate(served, BRANCH)[0]
    assert branch["meta_info"]["cached_tokens"] > 0, branch["meta_info"]
    assert branch["output_ids"] == expected["branch"]
    turn2 = _generate(served, expected["turn2"])[0]
    # Up to the last page boundary before the reply's last token (whose KV the first pass never computed).
    assert turn2["meta_info"]["cached_tokens"] >= 16 * ((len(prompt) + len(want) - 1) // 16), turn2["meta_info"]
    assert turn2["output_ids"] == expected["turn2_ids"]


def test_chunked_prefill_gives_whole_prefill_ids(expected: dict[str, Any], served: Any) -> None:
    """A 300-token prompt in five 64-token chunks: the tokens of the same kernels prefilling it in one step
    (and of the reference)."""
    assert served.flush_cache()
    assert served.server_args.chunked_prefill_size == CHUNK < len(LONG)
    reply = _generate(served, LONG)[0]
    assert reply["meta_info"]["cached_tokens"] == 0
    assert reply["output_ids"] == expected["long_whole"]
    assert reply["output_ids"] == expected["long"]


def test_serving_compiles_nothing_after_ready(served: Any) -> None:
    """After the precompile, requests of several batch sizes, lengths and sampling settings add no compilation
    (jax.monitoring's count, process-wide)."""
    stats = served.precompile_stats
    assert stats is not None and stats["programs"] > 0, stats
    before = compilation.jit_compilations()
    replies = []
    replies += _generate(served, ids(10, 3))  # batch 1, decode-only after one step
    replies += _generate(served, [ids(11, 5), ids(12, 70), ids(13, 200)])  # batch 3, chunked
    replies += _generate(served, [ids(20 + i, 10 + 17 * i) for i in range(6)])  # 6 requests, 4 run at a time
    replies += _generate(served, [ids(11, 5), ids(12, 70)])  # prefix-cache hits
    sampled = served.generate(input_ids=[ids(30, 20), ids(31, 33)], sampling_params={
        "temperature": 0.8, "top_p": 0.9, "top_k": 20, "max_new_tokens": 16, "ignore_eos": True})
    logprobs = served.generate(input_ids=ids(32, 40), sampling_params=dict(GREEDY, max_new_tokens=8),
                               return_logprob=True, top_logprobs_num=3, logprob_start_len=0)
    after = compilation.jit_compilations()
    assert after == before, f"{after - before} programs compiled while serving"
    # The requests ran (a counter that stood still because nothing ran proves nothing).
    assert [len(r["output_ids"]) for r in replies] == [GREEDY["max_new_tokens"]] * len(replies)
    assert [len(r["output_ids"]) for r in sampled] == [16, 16]
    assert len(logprobs["meta_info"]["output_top_logprobs"]) == 8
    assert replies[-1]["meta_info"]["cached_tokens"] > 0
