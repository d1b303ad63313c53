"""The routed experts' SwiGLU FFN in one Pallas TPU kernel, one expert a grid step (prefill and verify-sized steps).

Math: for the token rows sorted by expert (``group_sizes``), row r of expert e gives
``down_e(silu(x_r gate_e) * (x_r up_e))``, rounded about as the model rounds it (model/moe.py through
``MoeBackend.grouped_swiglu`` / ``grouped``: each product rounded to the input dtype, the activation too; here
SiLU is one float32 ``x * sigmoid(x)`` rounded once). Rows past ``sum(group_sizes)`` come back undefined.

Why: at a 2,048-token prefill step of the 35B layout (16,384 rows over 128 experts) XLA's TPU ``ragged_dot``
takes 2.04 ms for an FFN whose expert weights (805 MB) need 1.15 ms at the v5e's HBM peak and whose flops need
0.52 ms (docs/performance.md, "MoE grouped matmul"): it visits (128-row tile, expert) pairs, a product at a time,
and the weight fetches do not hide behind the products. Here the grid walks the experts the rows touch, in
order; each step's weight blocks (gate, up and down of one expert) are the BlockSpec pipeline's, so the next
expert's ~6 MB stream in while this one's rows are multiplied, and the rows stay on chip between the three
products (no ``[M, I]`` activation in HBM). On the chip it beats ``ragged_dot`` at prefill steps and at 16 rows an
expert with 32-row tiles, and loses at smaller decode steps (``bench.grouped_matmul``), so kernels/moe_backend.py
serves it at those steps (``ffn_tile_rows``).

Rows: ``x`` and ``y`` stay in HBM; an expert's rows are read in tiles of ``tm``, double buffered (the next tile
is fetched while this one is multiplied; the next expert's first tile while the pipeline waits for its weights),
and written back a tile at a time, each write waited on before the next starts. Mosaic slices HBM only at
sublane-tile boundaries (8 rows of float32, 16 of bfloat16), so an expert's first tile starts at the boundary at
or before its first row, and the array's last tile is clamped to end at row M. The rows such a tile holds before
its expert's first belong to experts already written, and are written again unchanged: taken from the tile
written last (still in VMEM, where they end) when they fit one sublane tile, else (the clamped tile) read back
from ``y``. A tile may also run past its expert's rows into the next experts' (garbage until those experts,
later in the walk, write theirs). Experts with no rows are skipped: the grid's steps past the touched experts
repeat the last one's blocks (no fetch) and compute nothing.

VMEM: both weight blocks of an expert double-buffered (6 MB an expert at the 35B-A3B's shapes, 24 MB at the
397B's: the scoped limit asked goes up to 100 MiB, which the v5e's 128 MiB holds and Ironwood's 64 MiB does not;
there the intermediate dimension would have to be split).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from sglang_tpu_qwen.kernels.grouped_ffn import SCOPE
from sglang_tpu_qwen.utils.mxu_precision import operand_precision

TILE_ROWS = 128


def _kernel(order_ref, starts_ref, sizes_ref, count_ref, x_hbm, wg_ref, wu_ref, wd_ref, y_hbm, xbuf, ybuf, yold,
            sem, last_row, *, tm: int, rows: int, align: int, precision) -> None:
    # last_row[0]: first row of the tile written last (its write may still be in flight), -1 before the first.
    s = pl.program_id(0)
    count = count_ref[0]

    def first_row(e):  # the tile boundary at or before expert e's first row
        return jax.lax.div(starts_ref[e], align) * align

    def num_tiles(e):
        return jax.lax.div(starts_ref[e] + sizes_ref[e] - first_row(e) + tm - 1, tm)

    def tile_row(e, t):  # first row of expert e's tile t; the array's last tile ends at its last row
        return pl.multiple_of(jnp.minimum(first_row(e) + t * tm, rows - tm), align)

    def x_copy(row0, slot):
        return pltpu.make_async_copy(x_hbm.at[pl.ds(row0, tm)], xbuf.at[slot], sem.at[slot])

    def y_copy(row0):
        return pltpu.make_async_copy(ybuf, y_hbm.at[pl.ds(row0, tm)], sem.at[2])

    def read_back(row0):  # y's rows [row0, row0 + tm) into yold, waited on
        cp = pltpu.make_async_copy(y_hbm.at[pl.ds(row0, tm)], yold, sem.at[3])
        cp.start()
        cp.wait()

    @pl.when(s == 0)
    def _first_tile():
        last_row[0] = -1

        @pl.when(count > 0)
        def _():
            x_copy(tile_row(order_ref[0], 0), 0).start()

    def dot(a, b):
        return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=precision,
                                   preferred_element_type=jnp.float32)

    @pl.when(s < count)
    def _expert():
        e = order_ref[s]
        tiles = num_tiles(e)
        dt = xbuf.dtype

        def tile(t, carry):
            slot = jax.lax.rem(s + t, 2)  # lax: Mosaic lowers no sign (floor) arithmetic
            row0 = tile_row(e, t)
            x_copy(row0, slot).wait()

            @pl.when(t + 1 < tiles)
            def _():
                x_copy(tile_row(e, t + 1), 1 - slot).start()

            x = xbuf[slot]
            gate = dot(x, wg_ref[...]).astype(dt).astype(jnp.float32)
            up = dot(x, wu_ref[...]).astype(dt).astype(jnp.float32)
            act = (gate * jax.nn.sigmoid(gate)).astype(dt).astype(jnp.float32) * up
            y = dot(act.astype(dt), wd_ref[...]).astype(dt)

            # Rows of the tile before this expert's first (written by earlier experts) are written unchanged: from
            # the tile written last when they lie in one sublane tile of it (they end where it ends its expert's
            # rows, which are this expert's first), else read back from HBM once that write has landed.
            before = starts_ref[e] - row0
            off = row0 - last_row[0]
            in_last = (last_row[0] >= 0) & (before <= align) & (off >= 0) & (off + align <= tm)
            window = ybuf[pl.ds(pl.multiple_of(jnp.clip(off, 0, tm - align), align), align)]

            @pl.when(last_row[0] >= 0)  # the previous write (it may overlap this tile's rows)
            def _():
                y_copy(0).wait()

            pl.when((before > 0) & ~in_last)(functools.partial(read_back, row0))
            keep = jax.lax.broadcasted_iota(jnp.int32, (tm, 1), 0) < before
            ybuf[0:align] = jnp.where(keep[0:align], jnp.where(in_last, window, yold[0:align]), y[0:align])
            if tm > align:  # static: a one-sublane-tile tile has no rows past the window
                ybuf[align:] = jnp.where(keep[align:], yold[align:], y[align:])
            y_copy(row0).start()
            last_row[0] = row0
            return carry

        jax.lax.fori_loop(0, tiles, tile, 0)

        @pl.when(s + 1 < count)
        def _():
            x_copy(tile_row(order_ref[s + 1], 0), jax.lax.rem(s + 1, 2)).start()

    @pl.when((s == pl.num_programs(0) - 1) & (last_row[0] >= 0))
    def _drain():
        y_copy(0).wait()


def vmem_bytes(h: int, i: int, dtype: jnp.dtype, tm: int = TILE_ROWS) -> int:
    """The kernel's VMEM blocks in bytes: an expert's three ``[H, I]`` weight blocks double-buffered, four row
    tiles of ``[tm, H]`` and the float32 products of a tile (``[tm, 2I + H]``, twice). It asks Mosaic for twice
    this (at least 32 MiB, at most 100 MiB)."""
    itemsize = jnp.dtype(dtype).itemsize
    return 2 * 3 * h * i * itemsize + 4 * tm * h * itemsize + tm * (2 * i + h) * 4 * 2


@functools.partial(jax.jit, static_argnames=("tm", "interpret"))
def grouped_ffn(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array, group_sizes: jax.Array, *,
                tm: int = TILE_ROWS, interpret: bool | pltpu.InterpretParams = False) -> jax.Array:
    """``down(silu(x gate) * (x up))`` of each row with its expert's weights (module docstring).

    Args:
        x: ``[M, H]`` rows sorted by expert, bf16 or float32 (float32 products at ``HIGHEST``).
        w_gate, w_up: ``[E, H, I]`` in x's dtype; w_down: ``[E, I, H]``.
        group_sizes: ``[E]`` int32 rows of each expert, summing to at most M.
        tm: rows a tile, a multiple of the dtype's sublane tile (16 rows of bf16, 8 of float32).
        interpret: Pallas TPU interpret mode (CPU): True, or its ``pltpu.InterpretParams``.

    Returns:
        ``[M, H]`` in x's dtype; rows past ``sum(group_sizes)`` undefined.

    Raises:
        ValueError: mismatched shapes or dtypes, H not a multiple of 128, or ``tm`` not a multiple of the dtype's
            sublane tile.
    """
    m, h = x.shape
    e, h2, i = w_gate.shape
    if (h2 != h or w_up.shape != w_gate.shape or w_down.shape != (e, i, h) or group_sizes.shape != (e,)
            or h % 128 or any(w.dtype != x.dtype for w in (w_gate, w_up, w_down))):
        raise ValueError(f"grouped_ffn: x {x.shape} {x.dtype}, gate {w_gate.shape} {w_gate.dtype}, up "
                         f"{w_up.shape} {w_up.dtype}, down {w_down.shape} {w_down.dtype}, group_sizes "
                         f"{group_sizes.shape} (H a multiple of 128, one dtype)")
    align = 8 * 4 // x.dtype.itemsize  # the dtype's sublane tile: HBM slices start on it
    if tm % align:
        raise ValueError(f"grouped_ffn: tm={tm} is not a multiple of {align} rows ({x.dtype})")
    rows = max(-(-m // align) * align, tm)
    if rows > m:  # rows to the tile boundary (or a whole tile: a decode-sized call, not this kernel's use)
        x = jnp.pad(x, ((0, rows - m), (0, 0)))
    sizes = group_sizes.astype(jnp.int32)
    starts = jnp.cumsum(sizes) - sizes
    touched = sizes > 0
    count = jnp.sum(touched, dtype=jnp.int32)
    # The touched experts in id order (so in row order), then the last of them repeated: its blocks stay.
    order = jnp.argsort(~touched, stable=True).astype(jnp.int32)
    order = jnp.where(jnp.arange(e) < count, order, order[jnp.maximum(count - 1, 0)])
    itemsize = x.dtype.itemsize
    weight_bytes = 3 * h * i * itemsize
    vmem = vmem_bytes(h, i, x.dtype, tm)
    precision = operand_precision(x.dtype)

    def block(shape):
        return pl.BlockSpec((None, *shape), lambda s, order, *_: (order[s], 0, 0))

    with jax.named_scope(SCOPE):
        y = pl.pallas_call(
            functools.partial(_kernel, tm=tm, rows=rows, align=align, precision=precision),
            grid_spec=pltpu.PrefetchScalarGridSpec(
                num_scalar_prefetch=4,
                grid=(e,),
                in_specs=[pl.BlockSpec(memory_space=pl.ANY), block((h, i)), block((h, i)), block((i, h))],
                out_specs=pl.BlockSpec(memory_space=pl.ANY),
                scratch_shapes=[pltpu.VMEM((2, tm, h), x.dtype), pltpu.VMEM((tm, h), x.dtype),
                                pltpu.VMEM((tm, h), x.dtype), pltpu.SemaphoreType.DMA((4,)),
                                pltpu.SMEM((1,), jnp.int32)],
            ),
            out_shape=jax.ShapeDtypeStruct((rows, h), x.dtype),
            # One walk in expert order: a tile's write may cover the next experts' rows, which they rewrite later.
            compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",),
                                                 vmem_limit_bytes=int(min(max(2 * vmem, 32 << 20), 100 << 20))),
            interpret=interpret if isinstance(interpret, pltpu.InterpretParams) else (
                pltpu.InterpretParams() if interpret else False),
            cost_estimate=pl.CostEstimate(flops=int(6 * m * h * i), transcendentals=int(m * i),
                                          bytes_accessed=int(e * weight_bytes + 2 * m * h * itemsize)),
        )(order, starts, sizes, jnp.reshape(count, (1,)), x, w_gate, w_up, w_down)
    return y[:m]
