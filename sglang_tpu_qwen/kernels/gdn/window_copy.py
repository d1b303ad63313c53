"""A batch's GDN conv windows gathered from and scattered into the conv pool by DMA (Pallas TPU kernels).

``fused_gdn`` reads each row's conv window (the slot's K-1 rows of one GDN layer) before its kernel and writes
it back after. As XLA's gather and scatter (``conv_pool.gather_windows`` / ``scatter_windows``) that traffic ran
at ~170 GB/s on the v5e, where the chip streams 819 GB/s: at 256 rows of the 35B-shaped model (conv_dim 8192,
K-1 = 3, float32) 25 MB per layer each way, ~0.45 ms a decode step in the scatter alone. In the pool's layout
``[L, S * (K-1), conv_dim / 128, 128]`` one slot's K-1 rows are one contiguous block (96 KiB there), so each
row's window is ONE contiguous DMA: these kernels start one per row, all at once, then wait for them all
(kernels/gdn/row_dmas.py, as ``slot_copy.copy_slots``), and move no other byte of the pool.

The windows travel as ``[B * (K-1), conv_dim / 128, 128]``, each row's block as it lies in the pool (the shape
of XLA's own gather). XLA turns them into (and from) the ``[B, K-1, conv_dim]`` the fused kernel's blocks read
and write: a relayout, as around its own gather and scatter, since that form's tiles hold a row's taps on
sublanes and the pool's a tap's channel blocks, which no DMA of whole tiles rearranges. XLA places the windows
in VMEM or HBM itself (the deviceless v5e compile of the 35B-shaped decode step: VMEM for its first GDN layer,
HBM and a prefetch for the others); a DMA runs from either.

Slots: 0 is the trash slot of padding rows. The gather reads it like any slot; in the scatter every padding
row writes it, several DMAs to the same bytes in any order: harmless, its content is garbage by contract.
Every other slot must appear at most once in a scatter (as for the XLA scatter, which then picks any one).
A slot outside ``[0, S)`` gathers the trash slot's window and scatters nothing (``scatter_windows`` drops
slots past the pool too; the step programs only pass rank-local slots in range).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from sglang_tpu_qwen.kernels.gdn.row_dmas import start_then_wait


def _in_range(slot: jax.Array, num_slots: int) -> jax.Array:
    return (slot >= 0) & (slot < num_slots)


def _gather_kernel(layer_ref, slot_ref, pool_hbm, out_hbm, sem, *, taps: int, num_slots: int):
    def copy(b):
        s = slot_ref[b]
        s = jnp.where(_in_range(s, num_slots), s, 0)
        return [pltpu.make_async_copy(pool_hbm.at[layer_ref[0], pl.ds(s * taps, taps)],
                                      out_hbm.at[pl.ds(b * taps, taps)], sem.at[0])]

    start_then_wait(slot_ref.shape[0], copy)


def _scatter_kernel(layer_ref, slot_ref, win_hbm, _pool_in, pool_hbm, sem, *, taps: int, num_slots: int):
    def copy(b):
        dst = pool_hbm.at[layer_ref[0], pl.ds(slot_ref[b] * taps, taps)]
        return [pltpu.make_async_copy(win_hbm.at[pl.ds(b * taps, taps)], dst, sem.at[0])]

    start_then_wait(slot_ref.shape[0], copy, when=lambda b: _in_range(slot_ref[b], num_slots))


def _scalars(layer: jax.Array | int, slots: jax.Array) -> tuple[jax.Array, jax.Array]:
    return jnp.reshape(jnp.asarray(layer, jnp.int32), (1,)), slots.astype(jnp.int32)


def _num_slots(conv_pool: jax.Array, taps: int) -> int:
    num_slots, rest = divmod(conv_pool.shape[1], taps)
    if rest or not num_slots:
        raise ValueError(f"conv pool {conv_pool.shape} does not split into slots of {taps} rows")
    return num_slots


def _cost(conv_pool: jax.Array, rows: int, taps: int) -> pl.CostEstimate:
    """XLA cannot see in: each row's window read once and written once (not the pool operand). Where XLA keeps
    the windows' side in VMEM (it does for some layers of a decode step) only half of that crosses HBM."""
    window = taps * conv_pool.shape[2] * conv_pool.shape[3] * conv_pool.dtype.itemsize
    return pl.CostEstimate(flops=0, transcendentals=0, bytes_accessed=2 * rows * window)


def gather_rows(conv_pool: jax.Array, layer: jax.Array | int, slots: jax.Array, taps: int, *,
                interpret: bool = False) -> jax.Array:
    """The windows of ``slots`` in GDN layer ``layer`` as the pool holds them, one DMA per row.

    Args:
        conv_pool: ``[L, S * taps, conv_dim / lanes, lanes]`` (kernels/gdn/conv_pool.py), any dtype.
        layer: GDN-layer index, int32 scalar (may be traced), in ``[0, L)``.
        slots: ``[B]`` int32 slot ids; a slot outside ``[0, S)`` reads slot 0 (module docstring).
        taps: ``K - 1``, pool rows per slot (``conv_pool.shape[1]`` must be a multiple).
        interpret: Pallas TPU interpret mode (CPU).

    Returns:
        ``[B * taps, conv_dim / lanes, lanes]`` in the pool's dtype: row ``b``'s window is ``[b * taps, (b+1) *
        taps)``.

    Raises:
        ValueError: when the pool's rows do not split into slots of ``taps``.
    """
    num_slots = _num_slots(conv_pool, taps)
    b = slots.shape[0]
    if b == 0:
        return jnp.zeros((0, *conv_pool.shape[2:]), conv_pool.dtype)
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    return pl.pallas_call(
        functools.partial(_gather_kernel, taps=taps, num_slots=num_slots),
        grid_spec=pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=2, grid=(1,), in_specs=[any_spec],
                                               out_specs=any_spec, scratch_shapes=[pltpu.SemaphoreType.DMA((1,))]),
        out_shape=jax.ShapeDtypeStruct((b * taps, *conv_pool.shape[2:]), conv_pool.dtype),
        interpret=pltpu.InterpretParams() if interpret else False,
        cost_estimate=_cost(conv_pool, b, taps),
    )(*_scalars(layer, slots), conv_pool)


def scatter_rows(conv_pool: jax.Array, layer: jax.Array | int, slots: jax.Array, rows: jax.Array, *,
                 interpret: bool = False) -> jax.Array:
    """``conv_pool`` (updated in place: aliased in and out) with layer ``layer``'s windows of ``slots`` set to
    ``rows``, one DMA per row; no other byte of the pool moves.

    Args:
        conv_pool: ``[L, S * taps, conv_dim / lanes, lanes]`` (kernels/gdn/conv_pool.py).
        layer: GDN-layer index, int32 scalar (may be traced), in ``[0, L)``.
        slots: ``[B]`` int32 slot ids: slot 0 (padding rows) any number of times, every other slot at most
            once; a slot outside ``[0, S)`` writes nothing (module docstring).
        rows: ``[B * taps, conv_dim / lanes, lanes]`` in the pool's dtype (:func:`gather_rows`' form).
        interpret: Pallas TPU interpret mode (CPU).

    Returns:
        The pool.

    Raises:
        ValueError: when ``rows`` does not match the pool's row shape and dtype, or the pool's rows do not split
            into slots of ``taps``.
    """
    b = slots.shape[0]
    taps, rest = divmod(rows.shape[0], max(b, 1))
    if rest or rows.shape[1:] != conv_pool.shape[2:] or rows.dtype != conv_pool.dtype or slots.ndim != 1:
        raise ValueError(f"windows {rows.shape} {rows.dtype} for slots {slots.shape} do not fit the conv pool "
                         f"{conv_pool.shape} {conv_pool.dtype}")
    if b == 0:
        return conv_pool
    num_slots = _num_slots(conv_pool, taps)
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    return pl.pallas_call(
        functools.partial(_scatter_kernel, taps=taps, num_slots=num_slots),
        grid_spec=pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=2, grid=(1,), in_specs=[any_spec, any_spec],
                                               out_specs=any_spec, scratch_shapes=[pltpu.SemaphoreType.DMA((1,))]),
        out_shape=jax.ShapeDtypeStruct(conv_pool.shape, conv_pool.dtype),
        input_output_aliases={3: 0},  # operands count the 2 scalar-prefetch ones
        interpret=pltpu.InterpretParams() if interpret else False,
        cost_estimate=_cost(conv_pool, b, taps),
    )(*_scalars(layer, slots), rows, conv_pool)


@functools.partial(jax.jit, static_argnames=("taps", "interpret"))
def gather_windows_dma(conv_pool: jax.Array, layer: jax.Array | int, slots: jax.Array, taps: int, *,
                       interpret: bool = False) -> jax.Array:
    """``conv_pool.gather_windows`` by DMA: ``[B, taps, conv_dim]`` in the pool's dtype, equal to it bit for bit
    for slots in range (:func:`gather_rows`, then XLA's relayout)."""
    rows = gather_rows(conv_pool, layer, slots, taps, interpret=interpret)
    return rows.reshape(slots.shape[0], taps, conv_pool.shape[2] * conv_pool.shape[3])


@functools.partial(jax.jit, static_argnames=("interpret",), donate_argnums=(0,))
def scatter_windows_dma(conv_pool: jax.Array, layer: jax.Array | int, slots: jax.Array, windows: jax.Array, *,
                        interpret: bool = False) -> jax.Array:
    """``conv_pool.scatter_windows`` by DMA: the pool (donated, updated in place) with layer ``layer``'s windows
    of ``slots [B]`` set to ``windows [B, K-1, conv_dim]`` cast to the pool's dtype (XLA's relayout and cast,
    then :func:`scatter_rows`); equal to it bit for bit for slots in range, slot 0 aside when several rows
    write it."""
    b, taps, _ = windows.shape
    rows = windows.reshape(b * taps, *conv_pool.shape[2:]).astype(conv_pool.dtype)
    return scatter_rows(conv_pool, layer, slots, rows, interpret=interpret)
