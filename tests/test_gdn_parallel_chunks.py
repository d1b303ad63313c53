"""The XLA parallel-chunk form of the gated delta rule (kernels/gdn/parallel_chunks.py), the TPU prefill
candidate, against the references on the CPU: the token-by-token recurrence at float32 (max abs error 1e-5,
values O(1)), and over the state pools against ``fused_gdn_reference`` (the kernel's reference wrapper).
A bfloat16 model's single-pass products stay at bf16 rounding level (relative rms under 1e-2), as the fused
kernel's chunked form does (tests/test_kernels_gdn.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_kernels_gdn import CONV_DIM, DIMS, K, _pools, _step

from sglang_tpu_qwen.kernels.gdn.delta_rule import l2_normalize, recurrent_gated_delta_rule
from sglang_tpu_qwen.kernels.gdn.parallel_chunks import fused_gdn_parallel, parallel_chunk_gated_delta_rule
from sglang_tpu_qwen.kernels.gdn.reference import fused_gdn_reference


def _rel_rms(a: np.ndarray, ref: np.ndarray) -> float:
    return float(np.sqrt(np.mean((a - ref) ** 2) / np.mean(ref**2)))


@pytest.mark.parametrize("t", [1, 64, 150])
def test_equals_the_recurrence(t: int) -> None:
    """Several chunks (150 = 2 full + a padded third), exactly one, and one token; a non-zero start state."""
    rng = np.random.default_rng(30)
    b, h, dk, dv = 2, 3, 16, 8
    q = l2_normalize(jnp.asarray(rng.standard_normal((b, t, h, dk)), jnp.float32)) * dk**-0.5
    k = l2_normalize(jnp.asarray(rng.standard_normal((b, t, h, dk)), jnp.float32))
    v = jnp.asarray(rng.standard_normal((b, t, h, dv)), jnp.float32)
    g = jnp.asarray(-rng.uniform(0, 0.5, (b, t, h)), jnp.float32)
    beta = jnp.asarray(rng.uniform(0, 1, (b, t, h)), jnp.float32)
    s0 = jnp.asarray(rng.standard_normal((b, h, dk, dv)), jnp.float32)
    with jax.default_matmul_precision("highest"):
        o_r, s_r = (np.asarray(x) for x in recurrent_gated_delta_rule(q, k, v, g, beta, s0))
    o_p, s_p = (np.asarray(x) for x in parallel_chunk_gated_delta_rule(q, k, v, g, beta, s0))
    assert o_p.shape == o_r.shape and s_p.shape == s_r.shape
    assert np.abs(o_p - o_r).max() <= 1e-5 and np.abs(s_p - s_r).max() <= 1e-5
    o_b, s_b = (np.asarray(x) for x in parallel_chunk_gated_delta_rule(q, k, v, g, beta, s0, bf16=True))
    assert 1e-5 < max(_rel_rms(o_b, o_r), _rel_rms(s_b, s_r)) < 1e-2  # rounded, at bf16 level


def test_over_the_pools_equals_the_reference() -> None:
    """``fused_gdn_parallel`` over the pools: two prefills (one fresh, one continuing a cached state) on slots
    out of order give the reference's outputs and pools (float32 inputs: the HIGHEST products)."""
    rng = np.random.default_rng(31)
    mixed, g, beta, lens = _step(rng, [150, 129], 150)
    conv_w = jnp.asarray(rng.standard_normal((CONV_DIM, K)) * 0.5, jnp.float32)
    conv, rec = _pools(rng)
    slots, fresh = jnp.asarray([6, 3], jnp.int32), jnp.asarray([True, False])
    o_r, conv_r, rec_r = fused_gdn_reference(mixed, conv_w, g, beta, conv, rec, 1, slots, lens, fresh, **DIMS)
    o_p, conv_p, rec_p = fused_gdn_parallel(mixed, conv_w, g, beta, conv, rec, 1, slots, lens, fresh, **DIMS)
    valid = np.arange(150)[None, :] < np.asarray(lens)[:, None]
    assert np.abs(np.asarray(o_p - o_r))[valid].max() <= 1e-4
    np.testing.assert_array_equal(np.asarray(conv_p), np.asarray(conv_r))  # the same conv, no delta rule
    assert np.abs(np.asarray(rec_p - rec_r)).max() <= 1e-4
    np.testing.assert_array_equal(np.asarray(rec_p)[0], np.asarray(rec)[0])  # the other layer untouched


def test_repeated_token_equals_the_recurrence() -> None:
    """One repeated key per row, write strength 0.99, no decay: chunk systems whose powers of L explode (the
    nilpotent product the form used before was off by 1e7 here; kernels/gdn/unit_lower_inverse.py)."""
    rng = np.random.default_rng(32)
    b, t, h, dk, dv = 2, 128, 2, 16, 8
    k = l2_normalize(jnp.asarray(np.broadcast_to(rng.standard_normal((b, 1, h, dk)), (b, t, h, dk)), jnp.float32))
    q = k * dk**-0.5
    v = jnp.asarray(rng.standard_normal((b, t, h, dv)), jnp.float32)
    g, beta = jnp.zeros((b, t, h), jnp.float32), jnp.full((b, t, h), 0.99, jnp.float32)
    s0 = jnp.asarray(rng.standard_normal((b, h, dk, dv)), jnp.float32)
    with jax.default_matmul_precision("highest"):
        o_r, s_r = (np.asarray(x) for x in recurrent_gated_delta_rule(q, k, v, g, beta, s0))
    o_p, s_p = (np.asarray(x) for x in parallel_chunk_gated_delta_rule(q, k, v, g, beta, s0))
    assert np.abs(o_p - o_r).max() <= 1e-4 and np.abs(s_p - s_r).max() <= 1e-4
