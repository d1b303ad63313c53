"""The routed experts on the chip with ``--moe-group-align``: XLA:TPU's ``ragged_dot`` on the aligned layout
gives the packed layout's output bit for bit.

A prefill step's shape of routing (2,048 tokens, top-8 of 128 experts: ~128 rows an expert, so in the packed
layout nearly every 128-row tile of the grouped matmul holds two experts' rows, and aligned none does), bf16 as
served, narrow expert matrices (the grouping, not the width, is under test). Each output row is its own row's
products whichever tile holds it, so the two layouts must agree exactly; a wrong gather shows as whole rows off.
Off the chip (the suite's CPU switch) the same check runs on XLA:CPU's ``ragged_dot``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from sglang_tpu_qwen.kernels.moe_backend import MoeBackend
from sglang_tpu_qwen.model.moe import route, routed_experts


def test_aligned_groups_equal_packed_on_chip() -> None:
    tokens, hidden, inter, experts, top_k = 2048, 256, 128, 128, 8
    keys = jax.random.split(jax.random.key(7), 5)
    x = jax.random.normal(keys[0], (tokens, hidden), jnp.bfloat16)
    router = jax.random.normal(keys[1], (hidden, experts), jnp.bfloat16)
    w_gate, w_up = (jax.random.normal(k, (experts, hidden, inter), jnp.bfloat16) * 0.05 for k in keys[2:4])
    w_down = jax.random.normal(keys[4], (experts, inter, hidden), jnp.bfloat16) * 0.05
    weights, ids = route(x, router, top_k, True)
    aligned_backend = MoeBackend(group_align=128)
    assert aligned_backend.group_alignment(tokens * top_k, experts, w_gate) == 128

    def run(backend: MoeBackend) -> np.ndarray:
        fn = jax.jit(lambda *a: routed_experts(*a, backend=backend))
        return np.asarray(fn(x, weights, ids, w_gate, w_up, w_down).astype(jnp.float32))

    packed, aligned = run(MoeBackend()), run(aligned_backend)
    assert np.all(np.isfinite(packed)) and np.abs(packed).max() > 0
    np.testing.assert_array_equal(aligned, packed)
