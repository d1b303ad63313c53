"""The GDN conv-state pool's slot <-> rows helpers against a plain [L, S, K-1, C] view of the same array."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from sglang_tpu_qwen.kernels.gdn import conv_pool

L, S, TAPS, C = 3, 5, 3, 16


def _pool() -> tuple[jnp.ndarray, np.ndarray]:
    host = np.random.default_rng(0).standard_normal(conv_pool.pool_shape(L, S, C, TAPS)).astype(np.float32)
    return jnp.asarray(host), host.reshape(L, S, TAPS, C)  # the view: [layer, slot, tap, channel]


def test_windows_are_the_slots_rows() -> None:
    pool, view = _pool()
    slots = jnp.asarray([4, 0, 2], jnp.int32)
    np.testing.assert_array_equal(conv_pool.gather_windows(pool, 1, slots, TAPS), view[1, [4, 0, 2]])
    windows = jnp.full((3, TAPS, C), 7.0)
    out = np.asarray(conv_pool.scatter_windows(pool, 2, slots, windows)).reshape(view.shape)
    want = view.copy()
    want[2, [4, 0, 2]] = 7.0
    np.testing.assert_array_equal(out, want)


def test_one_slot_travels_as_conv_dim_by_taps() -> None:
    pool, view = _pool()
    state = np.asarray(conv_pool.read_slot(pool, 3, TAPS))
    np.testing.assert_array_equal(state, np.swapaxes(view[:, 3], 1, 2))  # [L, C, K-1], HF's orientation
    back = np.asarray(conv_pool.write_slot(pool, 1, jnp.asarray(state))).reshape(view.shape)
    want = view.copy()
    want[:, 1] = view[:, 3]
    np.testing.assert_array_equal(back, want)
    # A slot past the pool (per-rank padding) is dropped, not clamped onto the last slot.
    np.testing.assert_array_equal(np.asarray(conv_pool.write_slot(pool, S, jnp.asarray(state))), np.asarray(pool))


def test_taps_of() -> None:
    pool, _ = _pool()
    assert conv_pool.taps_of(pool, S) == TAPS
    with pytest.raises(ValueError, match="does not hold"):
        conv_pool.taps_of(pool, S + 1)
