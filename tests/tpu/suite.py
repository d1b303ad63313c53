"""What the TPU suite's modules share: where it runs, the engines' common flags, and engine lifetimes.

Nothing here touches JAX at import time: the conftest imports it on every machine, where the suite is
collected and skipped.
"""

from __future__ import annotations

import functools
import gc
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

# Set to 1 to run the suite on the CPU (Pallas kernels in interpret mode, fewer heads in the kernel tests):
# a check of the tests' logic, not of the chip.
ON_CPU_ENV = "SGLANG_TPU_QWEN_TPU_SUITE_ON_CPU"

# Every engine of the suite: float32 compute and state, the default 16-token pages, small pools (the chip has
# 15.75 GiB; a shut-down engine's buffers go only when the collector runs, so the suite never relies on the
# memory-filling defaults) and 4 running requests. No grammar backend: constrained decoding is host code
# (xgrammar imports torch), tested on CPU, and no test here constrains.
ENGINE_KWARGS: dict[str, Any] = dict(dtype="float32", page_size=16, max_running_requests=4, context_length=512,
                                     max_total_tokens=4096, max_gdn_snapshots=16, grammar_backend="none")
PALLAS: dict[str, Any] = dict(attention_backend="pallas", gdn_backend="pallas")
REFERENCE: dict[str, Any] = dict(attention_backend="reference", gdn_backend="reference")
# Greedy, every request runs its full length.
GREEDY: dict[str, Any] = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}


def suite_on_cpu() -> bool:
    """The debugging switch is on (``SGLANG_TPU_QWEN_TPU_SUITE_ON_CPU=1``)."""
    return os.environ.get(ON_CPU_ENV) == "1"


@functools.cache
def on_chip() -> bool:
    """JAX's default backend is a TPU (initialises the backends on first call)."""
    import jax

    return jax.default_backend() == "tpu"


def interpret() -> bool:
    """Run the Pallas kernels in interpret mode: off the chip (the CPU switch)."""
    return not on_chip()


def ids(seed: int, n: int) -> list[int]:
    """``n`` seeded token ids from the ordinary (non-special) part of the Qwen3.5 vocabulary."""
    import numpy as np

    return np.random.default_rng(seed).integers(1000, 240000, size=n).tolist()


@contextmanager
def highest_precision() -> Iterator[None]:
    """Float32 matrix products in full for every program compiled inside (XLA:TPU's default for a float32
    product is one bfloat16 pass, ~1e-3 off: enough to flip a greedy choice between two close logits)."""
    import jax

    before = jax.config.jax_default_matmul_precision
    jax.config.update("jax_default_matmul_precision", "highest")
    try:
        yield
    finally:
        jax.config.update("jax_default_matmul_precision", before)


@contextmanager
def running_engine(**kwargs: Any) -> Iterator[Any]:
    """An in-process Engine built from ServerArgs fields, shut down on exit. The collector runs before the build
    and after the shutdown: a shut-down engine sits in reference cycles, its device buffers with it."""
    from sglang_tpu_qwen.engine.engine import Engine

    gc.collect()
    eng = Engine(**kwargs)
    try:
        yield eng
    finally:
        eng.shutdown()
        del eng
        gc.collect()


def assert_memory_back(eng: Any) -> None:
    """Once the prefix cache is flushed, every KV page, GDN slot and snapshot slot of ``eng`` is free."""
    assert eng.flush_cache()
    mem = eng.get_server_info()["memory"]
    assert mem["kv_pages_free"] == mem["kv_pages_total"], mem
    assert mem["gdn_slots_free"] == mem["gdn_slots_total"], mem
    assert mem["snapshot_slots_free"] == mem["snapshot_slots_total"], mem


def output_ids(replies: dict | list[dict]) -> list[list[int]]:
    """The output ids of each reply (a single reply is a list of one)."""
    return [r["output_ids"] for r in (replies if isinstance(replies, list) else [replies])]
