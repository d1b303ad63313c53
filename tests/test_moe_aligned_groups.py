"""``--moe-group-align``: the routed experts with each expert's rows from a row-tile boundary give the packed
layout's output exactly, and the aligned layout puts every sorted row where the grouped matmul reads it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sglang_tpu_qwen.kernels.moe_backend import MoeBackend
from sglang_tpu_qwen.model.moe import aligned_groups, aligned_rows, routed_experts


@pytest.mark.parametrize("sizes,align", [([5, 0, 8, 3], 8), ([0, 0, 16, 0], 8), ([1, 1, 1, 1], 4), ([9, 7], 16)])
def test_aligned_layout_holds_each_row_once_at_a_group_start(sizes, align):
    gs = np.array(sizes, np.int32)
    rows = int(gs.sum())
    src, dest, padded = (np.asarray(a) for a in aligned_groups(jnp.asarray(gs), rows, align))
    assert src.shape == (aligned_rows(rows, len(gs), align),) and dest.shape == (rows,)
    np.testing.assert_array_equal(padded, -(-gs // align) * align)
    assert padded.sum() <= src.shape[0]
    np.testing.assert_array_equal(src[dest], np.arange(rows))  # aligned[dest] == sorted
    starts, padded_starts = np.cumsum(gs) - gs, np.cumsum(padded) - padded
    for g, n in enumerate(gs):
        # Group g's rows, in order, from an aligned start; its padding repeats row 0 and is never read back.
        assert padded_starts[g] % align == 0
        np.testing.assert_array_equal(src[padded_starts[g]: padded_starts[g] + n], starts[g] + np.arange(n))
        np.testing.assert_array_equal(src[padded_starts[g] + n: padded_starts[g] + padded[g]], 0)
    assert not set(dest) & set(range(padded.sum(), src.shape[0]))


def test_aligned_routed_experts_equal_packed():
    """Tokens over experts of uneven load (two empty), bf16: the aligned layout's output equals the packed one's
    bit for bit (each output row is the same products of the same row), and alignment applies only when the
    mean expert holds half a tile."""
    n, h, inter, e, k = 48, 64, 32, 6, 2
    keys = jax.random.split(jax.random.key(0), 5)
    x = jax.random.normal(keys[0], (n, h), jnp.bfloat16)
    w_gate, w_up = (jax.random.normal(kk, (e, h, inter), jnp.bfloat16) * 0.1 for kk in keys[1:3])
    w_down = jax.random.normal(keys[3], (e, inter, h), jnp.bfloat16) * 0.1
    ids = jnp.stack([jnp.arange(n) % 4, 4 - jnp.arange(n) % 3], axis=1).astype(jnp.int32)  # experts 0-4, 5 empty
    weights = jax.nn.softmax(jax.random.normal(keys[4], (n, k)), axis=-1)
    packed = routed_experts(x, weights, ids, w_gate, w_up, w_down, MoeBackend())
    aligned_backend = MoeBackend(group_align=16)
    assert aligned_backend.group_alignment(n * k, e, w_gate) == 16  # 96 rows over 6 experts: 16 a group
    aligned = routed_experts(x, weights, ids, w_gate, w_up, w_down, aligned_backend)
    np.testing.assert_array_equal(np.asarray(aligned, np.float32), np.asarray(packed, np.float32))
    # A decode step (a few rows an expert) stays packed; so does an FP8 stack's kernel.
    assert MoeBackend(group_align=128).group_alignment(64 * 8, 128, w_gate) == 0
    assert MoeBackend(group_align=128).group_alignment(2048 * 8, 128, w_gate) == 128
    with pytest.raises(ValueError, match="moe-group-align"):
        MoeBackend(group_align=-1)
