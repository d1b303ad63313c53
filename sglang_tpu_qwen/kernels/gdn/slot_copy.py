"""Copy GDN state slots within the pools in place (Pallas TPU kernel): the decode snapshot of a verify commit.

``copy_slots(conv_pool, rec_pool, src, dst)`` sets slot ``dst[b]`` of every GDN layer to slot ``src[b]``
(conv window and recurrent state) for the rows with ``dst[b] != 0``, and does nothing for the others (0 is the
trash slot: a row without a snapshot). Each copy is a DMA from HBM to HBM, one per (row, layer, pool), started
all at once and then waited for; the pools are aliased in and out and no other byte of them moves. An XLA
scatter of the same copies would gather every row's state (snapshot or not) into a temporary and write it again:
``2 B`` states per layer read and written for the few rows that take a snapshot.

Layouts as ``kernels/gdn/kernel.py``: ``conv_pool [L, S * (K-1), conv_dim / 128, 128]`` (slot ``s`` owns rows
``[s * (K-1), (s+1) * (K-1))``, kernels/gdn/conv_pool.py) and ``rec_pool [L, S, Hv, dk, dv]``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from sglang_tpu_qwen.kernels.gdn.row_dmas import start_then_wait


def _copy_kernel(src_ref, dst_ref, _conv_in, _rec_in, conv_hbm, rec_hbm, sem, *, taps: int):
    rows, layers = src_ref.shape[0], rec_hbm.shape[0]

    def copies(i):  # i: row b = i // layers, layer i % layers (row-major, as the rows' loop over layers)
        b, layer = jax.lax.div(i, layers), jax.lax.rem(i, layers)
        s, d = src_ref[b], dst_ref[b]
        return (pltpu.make_async_copy(rec_hbm.at[layer, s], rec_hbm.at[layer, d], sem.at[0]),
                pltpu.make_async_copy(conv_hbm.at[layer, pl.ds(s * taps, taps)],
                                      conv_hbm.at[layer, pl.ds(d * taps, taps)], sem.at[1]))

    start_then_wait(rows * layers, copies, when=lambda i: dst_ref[jax.lax.div(i, layers)] != 0)


@functools.partial(jax.jit, static_argnames=("taps", "interpret"), donate_argnums=(0, 1))
def copy_slots(conv_pool: jax.Array, rec_pool: jax.Array, src: jax.Array, dst: jax.Array, *, taps: int,
               interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """Both pools (donated, updated in place) with slot ``dst[b]`` set to slot ``src[b]`` in every layer, for
    each ``b`` with ``dst[b] != 0``.

    Args:
        conv_pool: ``[L, S * taps, conv_dim / 128, 128]`` conv windows (kernels/gdn/conv_pool.py).
        rec_pool: ``[L, S, Hv, dk, dv]`` recurrent states.
        src, dst: ``[B]`` int32 slot ids; ``dst[b] == 0`` (the trash slot) copies nothing for row ``b``. The
            ``dst`` slots of copying rows must be distinct and no ``src`` slot (a snapshot slot is private).
        taps: ``K - 1``, conv rows per slot.
        interpret: Pallas TPU interpret mode (CPU).

    Returns:
        ``(conv_pool, rec_pool)``.
    """
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    state_bytes = (rec_pool[0, 0].size * rec_pool.dtype.itemsize + taps * conv_pool[0, 0].size
                   * conv_pool.dtype.itemsize) * rec_pool.shape[0]
    return pl.pallas_call(
        functools.partial(_copy_kernel, taps=taps),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2, grid=(1,), in_specs=[any_spec, any_spec], out_specs=[any_spec, any_spec],
            scratch_shapes=[pltpu.SemaphoreType.DMA((2,))]),
        out_shape=[jax.ShapeDtypeStruct(conv_pool.shape, conv_pool.dtype),
                   jax.ShapeDtypeStruct(rec_pool.shape, rec_pool.dtype)],
        input_output_aliases={2: 0, 3: 1},  # operands count the 2 scalar-prefetch ones
        interpret=pltpu.InterpretParams() if interpret else False,
        # XLA cannot see in: at most every row's state read and written once (only the snapshot rows' move).
        cost_estimate=pl.CostEstimate(flops=0, transcendentals=0, bytes_accessed=int(2 * src.shape[0] * state_bytes)),
    )(src.astype(jnp.int32), dst.astype(jnp.int32), conv_pool, rec_pool)
