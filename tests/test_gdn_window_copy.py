"""kernels/gdn/window_copy.py in Pallas interpret mode (CPU) against XLA's gather / scatter of conv_pool.py.

Bit for bit: the same windows gathered (trash slot 0 repeated, slots out of order, a traced layer), the same pool
after a scatter (windows cast to a bfloat16 pool; every byte outside the written slots untouched), with slot 0
written by several padding rows holding one of their windows (the trash slot is garbage by contract, and the
XLA scatter and the DMAs may pick different rows). Both lane forms of the pool: 128-lane blocks and a
``conv_dim`` that 128 does not divide (one block of all channels).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sglang_tpu_qwen.kernels.gdn import conv_pool
from sglang_tpu_qwen.kernels.gdn.window_copy import gather_rows, gather_windows_dma, scatter_rows, scatter_windows_dma

L, S, TAPS = 3, 9, 3
SLOTS = [5, 0, 2, 8, 0, 1, 0]  # three padding rows on the trash slot, slots out of order


def _pool(conv_dim: int, dtype, seed: int = 0) -> jax.Array:
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.standard_normal(conv_pool.pool_shape(L, S, conv_dim, TAPS)), dtype)


@pytest.mark.parametrize("conv_dim", [256, 96])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gather_equals_xla(conv_dim: int, dtype) -> None:
    pool, slots = _pool(conv_dim, dtype), jnp.asarray(SLOTS, jnp.int32)
    for layer in (0, 2):
        got = jax.jit(lambda p, lay: gather_windows_dma(p, lay, slots, TAPS, interpret=True))(pool, layer)
        want = conv_pool.gather_windows(pool, layer, slots, TAPS)
        assert got.shape == (len(SLOTS), TAPS, conv_dim) and got.dtype == dtype
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("conv_dim", [256, 96])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_scatter_equals_xla(conv_dim: int, dtype) -> None:
    pool, slots = _pool(conv_dim, dtype), jnp.asarray(SLOTS, jnp.int32)
    windows = jnp.asarray(np.random.default_rng(1).standard_normal((len(SLOTS), TAPS, conv_dim)), jnp.float32)
    want = np.asarray(conv_pool.scatter_windows(pool, 1, slots, windows))
    got = np.asarray(scatter_windows_dma(jnp.array(pool, copy=True), jnp.int32(1), slots, windows, interpret=True))
    assert got.dtype == dtype
    # Past the trash slot's rows: every byte as XLA's scatter leaves it (written slots and untouched ones alike).
    np.testing.assert_array_equal(got[:, TAPS:], want[:, TAPS:])
    np.testing.assert_array_equal(got[[0, 2], :TAPS], np.asarray(pool)[[0, 2], :TAPS])  # other layers' slot 0
    trash = got[1, :TAPS].reshape(TAPS, conv_dim)
    pads = np.asarray(windows.astype(dtype))[[i for i, s in enumerate(SLOTS) if s == 0]]
    assert any(np.array_equal(trash, w) for w in pads)


def test_rows_are_the_pools_blocks() -> None:
    """gather_rows / scatter_rows move a slot's [K-1, conv_dim / 128, 128] block as the pool holds it."""
    pool, slots = _pool(256, jnp.float32), jnp.asarray([4, 7], jnp.int32)
    rows = gather_rows(pool, 2, slots, TAPS, interpret=True)
    view = np.asarray(pool).reshape(L, S, TAPS, 2, 128)
    np.testing.assert_array_equal(np.asarray(rows).reshape(2, TAPS, 2, 128), view[2, [4, 7]])
    back = np.asarray(scatter_rows(jnp.array(pool, copy=True), 0, jnp.asarray([7, 4], jnp.int32), rows,
                                   interpret=True)).reshape(view.shape)
    want = view.copy()
    want[0, [7, 4]] = view[2, [4, 7]]
    np.testing.assert_array_equal(back, want)


def test_out_of_range_slots() -> None:
    """A slot outside the pool gathers the trash slot's window and scatters nothing (XLA's scatter drops a slot
    past the pool as well)."""
    pool = _pool(256, jnp.float32)
    slots = jnp.asarray([S, 3, -1], jnp.int32)
    got = np.asarray(gather_windows_dma(pool, 1, slots, TAPS, interpret=True))
    trash = np.asarray(conv_pool.gather_windows(pool, 1, jnp.zeros(1, jnp.int32), TAPS))[0]
    np.testing.assert_array_equal(got[0], trash)
    np.testing.assert_array_equal(got[2], trash)
    np.testing.assert_array_equal(got[1], np.asarray(conv_pool.gather_windows(pool, 1, slots[1:2], TAPS))[0])
    windows = jnp.full((3, TAPS, 256), 7.0, jnp.float32)
    out = np.asarray(scatter_windows_dma(jnp.array(pool, copy=True), 1, slots, windows, interpret=True))
    np.testing.assert_array_equal(out, np.asarray(conv_pool.scatter_windows(pool, 1, slots[:2], windows[:2])))


def test_rejects_rows_that_do_not_fit() -> None:
    pool = _pool(256, jnp.float32)
    slots = jnp.asarray([1, 2], jnp.int32)
    with pytest.raises(ValueError, match="do not fit"):
        scatter_rows(pool, 0, slots, jnp.zeros((2 * TAPS, 2, 128), jnp.bfloat16), interpret=True)
    with pytest.raises(ValueError, match="do not fit"):
        scatter_rows(pool, 0, slots, jnp.zeros((2 * TAPS + 1, 2, 128), jnp.float32), interpret=True)
    with pytest.raises(ValueError, match="slots of"):
        gather_rows(pool, 0, slots, 4, interpret=True)
