"""Grouped matmul over block-FP8 weights, dequantised per tile in VMEM (Pallas TPU).

    x      [M, K]      bf16/f32   rows sorted by group: rows [start_g, end_g) use weight g
    q      [G, K, N]   float8_e4m3fn (our [in, out] layout)
    scale  [G, ceil(K/b0), ceil(N/b1)] float32; w[g] = q[g] * scale[g] blockwise (edge blocks partial)
    group_sizes [G] int32, sum <= M; rows past the sum come out 0
    -> [M, N] in x.dtype

XLA materialises a dequantised bf16 copy of the weight before ``ragged_dot`` (it does not fuse the
convert or the block-scale multiply into it: 5x the FP8 bytes on tpu7x, tools/plan/), so the weight would
cross HBM three times more than it must. Here each weight tile is read once as FP8, converted in VMEM,
and the block scale multiplies the f32 partial product of each ``b0``-row slab (exact: the scale is
constant over the slab's columns within one ``b1`` block), the formulation of DeepSeek-V3's block-FP8
GEMM. Grouping follows megablox (Pallas ``gmm``): the grid walks (group, row tile) visits in order, a
row tile shared by two groups is visited once per group with the other group's rows masked to zero,
and the accumulator lives across the visits of one tile. Visits past the last real one repeat its block
indices (no DMA) and skip the compute.

Grid: ``(N tiles, visits, K tiles)``; ``visits = ceil(M/tm) + G - 1`` (static upper bound).

:func:`fp8_grouped_swiglu` runs an expert's gate and up projections in one pass, SwiGLU
(Shazeer, "GLU Variants Improve Transformer", 2020) in the epilogue: each x tile is read once for both
weights and only ``silu(x @ w_gate) * (x @ w_up)``, optionally times a per-row scale (the routing weight),
leaves the kernel, instead of two ``[M, N]`` products read back by an elementwise pass.

:func:`fp8_grouped_matmul_scatter_add` adds each row's product into row ``dest[r]`` of an accumulator in
HBM (the MoE combine of expert-parallel layers: an expert's down projection summed into its token's row).
The rows of a visit are read from HBM by one DMA each while its matmul runs, the product added in VMEM and
written back while the next visit's matmul runs (that visit waits for the writes before reading: a token
routed to two experts of this device is added twice, in two visits), so no ``[M, N]`` product is written
for a scatter to read back. Mosaic slices an HBM array only at tile
boundaries of its two minor dims, so the accumulator is ``[R, N / 128, 128]``: each row its own run of
``(*, 128)`` tiles, addressable by a DMA.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from sglang_tpu_qwen.utils.mxu_precision import operand_precision


def _visits(group_sizes: jax.Array, tm: int, tiles_m: int, num_visits: int) -> tuple[jax.Array, ...]:
    """Per grid visit: (group id, row tile), plus group starts / ends and the number of real visits."""
    g = group_sizes.shape[0]
    sizes = group_sizes.astype(jnp.int32)
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    first = starts // tm
    count = jnp.where(sizes > 0, (ends - 1) // tm - first + 1, 0)
    cum = jnp.cumsum(count)
    total = cum[-1]
    t = jnp.arange(num_visits, dtype=jnp.int32)
    group = jnp.minimum(jnp.searchsorted(cum, t, side="right"), g - 1).astype(jnp.int32)
    tile = first[group] + t - (cum - count)[group]
    last = jnp.maximum(total - 1, 0)
    group = jnp.where(t < total, group, group[last])
    tile = jnp.clip(jnp.where(t < total, tile, tile[last]), 0, tiles_m - 1).astype(jnp.int32)
    return group, tile, starts, ends, jnp.reshape(total, (1,))


def _kernel(
    _layer_ref, group_ref, tile_ref, start_ref, end_ref, total_ref,  # scalar prefetch (SMEM)
    x_ref, *refs,
    tm: int, tk: int, tn: int, k_dim: int, block: tuple[int, int], swiglu: bool, row_scale: bool, scatter: bool,
    gather: bool, acc_in: bool = False, zeroing: bool = False,
):
    """One (N tile, visit, K tile) grid step. refs: (q, scale) per weight (two for SwiGLU: gate, up), the
    row scale [tm, 1] when given, for a gather the row ids of this visit's and the next visit's tiles
    (SMEM), for a scatter the tile's destination rows (SMEM), the accumulator's input (``acc_in``: aliased
    to the output) and the rows this visit zeroes (``zeroing``, SMEM), the output, one f32 accumulator per
    weight, then for a scatter a VMEM row buffer, a zero row and three DMA semaphores, for a gather two slots
    of gathered rows, the rows as a [tm, K] matrix and two DMA semaphores. With a gather, ``x_ref`` is the
    row source in HBM."""
    n_w = 2 if swiglu else 1
    weights = [refs[2 * i : 2 * i + 2] for i in range(n_w)]
    refs = refs[2 * n_w :]
    rs_ref, refs = (refs[0], refs[1:]) if row_scale else (None, refs)
    ids_refs, refs = (refs[:2], refs[2:]) if gather else (None, refs)
    dest_ref, zero_ref = None, None
    if scatter:
        dest_ref, refs = refs[0], refs[2 if acc_in else 1 :]
        zero_ref, refs = (refs[0], refs[1:]) if zeroing else (None, refs)
    o_ref, accs, rest = refs[0], refs[1 : 1 + n_w], refs[1 + n_w :]
    t, k = pl.program_id(1), pl.program_id(2)
    b0, b1 = block
    tile, grp = tile_ref[t], group_ref[t]
    x_in = x_ref
    if gather:
        x_in = rest[1]
        _gather_rows(x_ref, *ids_refs, *rest, group_ref, tile_ref, start_ref, end_ref, total_ref[0], tm)
    new_tile = jnp.logical_or(t == 0, tile_ref[jnp.maximum(t - 1, 0)] != tile)

    @pl.when(jnp.logical_and(k == 0, new_tile))
    def _zero():
        for acc_ref in accs:
            acc_ref[...] = jnp.zeros_like(acc_ref)

    @pl.when(t < total_ref[0])
    def _compute():
        rows = tile * tm + jax.lax.broadcasted_iota(jnp.int32, (tm, b0), 0)
        in_group = jnp.logical_and(rows >= start_ref[grp], rows < end_ref[grp])
        for i in range(tk // b0):
            kcol = k * tk + i * b0 + jax.lax.broadcasted_iota(jnp.int32, (tm, b0), 1)
            xs = x_in[:, i * b0 : (i + 1) * b0]
            xs = jnp.where(jnp.logical_and(in_group, kcol < k_dim), xs, 0).astype(x_ref.dtype)
            krow = k * tk + i * b0 + jax.lax.broadcasted_iota(jnp.int32, (b0, tn), 0)
            for (q_ref, s_ref), acc_ref in zip(weights, accs, strict=True):
                # Padding past K may hold any bits (NaN included): zero it, not just the matching x columns.
                ws = jnp.where(krow < k_dim, q_ref[i * b0 : (i + 1) * b0, :].astype(x_ref.dtype), 0)
                part = jnp.dot(xs, ws, precision=operand_precision(xs.dtype),
                               preferred_element_type=jnp.float32)  # [tm, tn]
                srow = s_ref[0, 0, pl.ds(k * (tk // b0) + i, 1), :]  # [1, tn // b1] float32
                s = jnp.concatenate([jnp.broadcast_to(srow[:, j : j + 1], (1, b1)) for j in range(tn // b1)],
                                    axis=1)
                acc_ref[...] += part * s

    if scatter:
        _scatter_add_rows(accs[0], dest_ref, o_ref, *rest, group_ref, tile_ref, start_ref, end_ref, total_ref[0],
                          t, k, pl.num_programs(2) - 1, tm)
        if zeroing:
            _zero_rows(zero_ref, o_ref, *rest, t, k, pl.num_programs(2) - 1)
        return

    @pl.when(k == pl.num_programs(2) - 1)
    def _store():
        out = jax.nn.silu(accs[0][...]) * accs[1][...] if swiglu else accs[0][...]
        if rs_ref is not None:
            out = out * rs_ref[...]
        o_ref[...] = out.astype(o_ref.dtype)


def _visit_rows(v: jax.Array, group_ref: Any, tile_ref: Any, start_ref: Any, end_ref: Any,
                tm: int) -> tuple[jax.Array, jax.Array]:
    """``[lo, hi)``: the rows of visit ``v``'s tile that belong to its group (tile-relative)."""
    base, g = tile_ref[v] * tm, group_ref[v]
    return jnp.clip(start_ref[g] - base, 0, tm), jnp.clip(end_ref[g] - base, 0, tm)


def _gather_rows(x_hbm: Any, ids_ref: Any, next_ids_ref: Any, xbuf: Any, x2d: Any, sem: Any, group_ref: Any,
                 tile_ref: Any, start_ref: Any, end_ref: Any, total: jax.Array, tm: int) -> None:
    """Put the rows of visit ``t``'s group (``x_hbm[ids[r]]``, one DMA per row) into ``x2d`` rows ``r``; rows
    of other groups hold stale values, which the matmul masks. Double-buffered: each grid step waits for its
    own rows, fetched by the step before (the first step fetches its own), and starts the next real visit's
    (the next visit of this N tile, or visit 0 of the next N tile) into the other slot, to land during this
    step's matmul. The grid's K axis has one step (the rows are whole)."""
    j, t, n_j, n_t = pl.program_id(0), pl.program_id(1), pl.num_programs(0), pl.num_programs(1)
    step = j * n_t + t
    nxt = jnp.where(t + 1 < total, t + 1, 0)
    has_next = jnp.logical_or(t + 1 < total, jnp.logical_and(t == total - 1, j + 1 < n_j))

    rows = functools.partial(_visit_rows, group_ref=group_ref, tile_ref=tile_ref, start_ref=start_ref,
                             end_ref=end_ref, tm=tm)

    def copies(v: jax.Array, ids: Any, slot: jax.Array, start: bool) -> None:
        def one(r: jax.Array) -> None:
            dma = pltpu.make_async_copy(x_hbm.at[ids[tile_ref[v] & 7, r]], xbuf.at[slot, r], sem.at[slot])
            dma.start() if start else dma.wait()

        pl.loop(*rows(v))(one)

    pl.when(jnp.logical_and(step == 0, t < total))(lambda: copies(t, ids_ref, step & 1, start=True))
    pl.when(has_next)(lambda: copies(nxt, next_ids_ref, 1 - (step & 1), start=True))

    @pl.when(t < total)
    def _land():
        copies(t, ids_ref, step & 1, start=False)

        @pl.loop(*rows(t))
        def _(r):
            x2d[pl.ds(r, 1), :] = xbuf[step & 1, r].astype(jnp.float32).reshape(1, x2d.shape[1])


def _zero_rows(zero_ref: Any, out_hbm: Any, _buf_ref: Any, zrow: Any, sem: Any, t: jax.Array, k: jax.Array,
               last_k: jax.Array) -> None:
    """``out_hbm[row] = 0`` for the rows listed for visit ``t`` (``zero_ref[t & 7]``, -1 = none): one DMA each
    from a zero row in VMEM, started at the visit's first K step and waited for at its last. The listed rows
    are ones no product touches, so these writes never meet the scatter's."""
    def each(fn: Any) -> None:
        @pl.loop(0, zero_ref.shape[1])
        def _(j):
            row = zero_ref[t & 7, j]
            pl.when(row >= 0)(lambda: fn(row))

    def copy(row: jax.Array) -> Any:
        return pltpu.make_async_copy(zrow, out_hbm.at[pl.ds(row, 1)], sem.at[2])

    @pl.when(jnp.logical_and(t == 0, k == 0))
    def _():
        zrow[...] = jnp.zeros_like(zrow)

    pl.when(k == 0)(lambda: each(lambda row: copy(row).start()))
    pl.when(k == last_k)(lambda: each(lambda row: copy(row).wait()))


def _scatter_add_rows(acc_ref: Any, dest_ref: Any, out_hbm: Any, buf_ref: Any, _zrow: Any, sem: Any, group_ref: Any,
                      tile_ref: Any, start_ref: Any, end_ref: Any, total: jax.Array, t: jax.Array, k: jax.Array,
                      last_k: jax.Array, tm: int) -> None:
    """``out_hbm[dest[r]] += acc[r]`` for the rows of visit ``t``'s group in its tile, each product rounded to
    the output dtype first (as an unfused product would be before a scatter-add). A destination stored as
    ``-1 - dest`` is overwritten: its row is not read (nor waited for), the product is written.

    One DMA per row, overlapped with the matmuls: at the visit's first K step the previous visit's writes
    are waited for (this visit may read a row it wrote: a token routed to two of these experts) and this
    visit's reads are started; at its last K step the reads are waited for, the products added in VMEM and
    the writes started, to land during the next visit's matmul (the last visit waits for its own)."""
    rows = functools.partial(_visit_rows, group_ref=group_ref, tile_ref=tile_ref, start_ref=start_ref,
                             end_ref=end_ref, tm=tm)

    def overwrite(r: jax.Array) -> jax.Array:
        return dest_ref[tile_ref[t] & 7, r] < 0

    def copy(r: jax.Array, read: bool) -> Any:
        d = dest_ref[tile_ref[t] & 7, r]
        hbm, vmem = out_hbm.at[jnp.where(d < 0, -1 - d, d)], buf_ref.at[r]
        return pltpu.make_async_copy(hbm, vmem, sem.at[0]) if read else pltpu.make_async_copy(vmem, hbm, sem.at[1])

    def if_read(fn: Any) -> Any:  # fn(r) for the rows whose destination is read (not overwritten)
        return lambda r: pl.when(jnp.logical_not(overwrite(r)))(lambda: fn(r))

    def each(lo: jax.Array, hi: jax.Array, fn: Any) -> None:
        pl.loop(lo, hi)(fn)

    def wait_writes(v: jax.Array) -> None:
        # Every write moves one row: any row's descriptor waits for one of them.
        each(*rows(v), lambda r: pltpu.make_async_copy(buf_ref.at[0], out_hbm.at[0], sem.at[1]).wait())

    def add(r: jax.Array) -> None:
        part = acc_ref[pl.ds(r, 1), :].astype(buf_ref.dtype).astype(jnp.float32)
        prev = jnp.where(overwrite(r), 0.0, buf_ref[r].astype(jnp.float32))  # a select: stale bits never add
        buf_ref[r] = (prev + part.reshape(buf_ref.shape[1:])).astype(buf_ref.dtype)

    lo, hi = rows(t)

    @pl.when(jnp.logical_and(t < total, k == 0))
    def _fetch():
        pl.when(t > 0)(lambda: wait_writes(t - 1))  # runs when traced (pl.when calls its function)
        each(lo, hi, if_read(lambda r: copy(r, read=True).start()))

    @pl.when(jnp.logical_and(t < total, k == last_k))
    def _add_back():
        each(lo, hi, if_read(lambda r: copy(r, read=True).wait()))
        each(lo, hi, add)
        each(lo, hi, lambda r: copy(r, read=False).start())
        pl.when(t == total - 1)(lambda: wait_writes(t))


def _tile(dim: int, target: int, unit: int) -> int:
    """Tile size: ``dim`` rounded up to ``unit`` when that is at most ``target``, else ``target``."""
    full = -(-dim // unit) * unit
    return full if full <= target else target


def _vmem(tm: int, tk: int, tn: int, n_w: int, itemsize: int, k_dim: int) -> int:
    """VMEM bytes of one grid step by the kernel's estimate: double-buffered x, weight and output tiles, the
    f32 accumulators, the dequantised weight tile and the scale tiles (the scatter and gather add theirs)."""
    kb_pad = -(-k_dim // tk) * tk // 128
    vmem = 2 * (tm * tk * itemsize + n_w * tk * tn + tm * tn * itemsize) + n_w * tm * tn * 4
    return vmem + tk * tn * (itemsize + 4) + 2 * n_w * kb_pad * 128 * 4 + 2 * tm * 128 * 4


def linear_tiles(m: int, k: int, n: int, itemsize: int = 2, vmem_budget: int = 32 * 2**20) -> dict[str, int]:
    """Tiles ``{"tm", "tk", "tn"}`` for one group of ``m`` rows (a linear layer ``[m, k] @ [k, n]``) that move
    the fewest HBM bytes by :func:`_cost`'s count within ``vmem_budget`` of :func:`_vmem` (the kernel's VMEM
    limit is twice its estimate: 64 MiB, an Ironwood core's VMEM).

    The grid walks (N tile, row tile, K tile): with more than one K tile every row tile streams the whole
    weight again (its blocks change every step), so 128-row tiles at a 1024-token prefill read each weight 8
    times; one row tile reads it once, and x is read again per N tile unless it is one whole tile. Candidates:
    ``tm`` all rows (rounded to 16) or halves of it down to 128, ``tk`` all of K or 2048 / 1024 / 512 / 256,
    ``tn`` the widest multiple of 128 splitting N evenly (at most 6144, at least 256: the MXU's width) that
    fits. Ties go to fewer grid steps."""
    best: tuple[float, int, dict[str, int]] | None = None
    m16 = -(-m // 16) * 16
    tms = [m16] + [t for t in (1024, 512, 256, 128) if t < m16]
    k128 = -(-k // 128) * 128
    tks = sorted({k128, *(t for t in (2048, 1024, 512, 256) if t < k128)}, reverse=True)
    n128 = -(-n // 128) * 128
    for tm in tms:
        for tk in tks:
            for parts in range(max(1, -(-n128 // 6144)), n128 // 128 + 1):
                if (n128 // 128) % parts:
                    continue  # N split evenly: no partial edge tile
                tn = n128 // parts
                if tn < min(256, n128):
                    break  # narrower than the MXU (256 wide on Ironwood): fewer bytes, half the MXU idle
                if _vmem(tm, tk, tn, 1, itemsize, k) > vmem_budget:
                    continue
                steps = -(-m // tm) * -(-k // tk) * -(-n // tn)
                cost = _cost(m, k, n, 1, itemsize, tm, None, tiles_n=-(-n // tn), tiles_k=-(-k // tk)).bytes_accessed
                if best is None or (cost, steps) < best[:2]:
                    best = (cost, steps, {"tm": tm, "tk": tk, "tn": tn})
                break  # the widest fitting tn for this (tm, tk)
    if best is None:
        raise ValueError(f"no FP8 linear tiling of [{m}, {k}] @ [{k}, {n}] fits {vmem_budget} bytes of VMEM")
    # The default tiles (128-row, 512-deep, N split evenly into at most 6144 columns) unless they move over 1%
    # more: at decode (one row tile) they already read each weight once, and a block holding a whole small
    # weight let XLA prefetch that weight's 15-layer stack into VMEM every layer (397B's k/v projections:
    # +0.47 GiB per decode step).
    tn0 = -(-n128 // -(-n128 // 6144) // 128) * 128
    default = {"tm": min(m16, 128), "tk": min(512, k128), "tn": tn0}
    d_cost = _cost(m, k, n, 1, itemsize, default["tm"], None, tiles_n=-(-n // tn0),
                   tiles_k=-(-k // default["tk"])).bytes_accessed
    if _vmem(default["tm"], default["tk"], tn0, 1, itemsize, k) <= vmem_budget and d_cost <= 1.01 * best[0]:
        return default
    return best[2]


def _cost(m: int, k: int, n: int, g: int, itemsize: int, tm: int, expected_rows: int | None,
          n_w: int = 1, scatter: bool = False, gather: bool = False, tiles_n: int = 1,
          overwrites: int = 0, zeros: int = 0, tiles_k: int = 1) -> pl.CostEstimate:
    """XLA cannot see into the kernel; this is its traffic, counted the way Pallas's pipeline moves blocks (a
    block is copied in only when its index differs from the previous grid step's, written back when the
    output's index changes).

    Weights (``n_w`` of them): FP8 bytes of the groups that have rows, ``G * (1 - (1 - 1/G) ** rows)`` of them
    for rows routed uniformly (all G when ``expected_rows`` is None), and scales once per visited group: each
    once when the K axis has one tile (a group's visits keep its block), else once per visit (the K blocks
    change every step: a group spanning r row tiles streams its weight r times). Activations: the row tiles
    the groups cover (the rows, rounded up to whole tiles) read once per N tile, or once in all when they
    are one tile and K one tile (the block never changes); with several K tiles, a tile shared by two groups
    is read once per group. Outputs: the covered tiles, written once. A gather reads the covered rows only,
    once per N tile; a scatter reads and writes each covered row's destination instead of writing the
    output (``overwrites`` of them only written), and writes the ``zeros`` rows it zeroes."""
    rows = m if expected_rows is None else expected_rows
    active = g * (1.0 - (1.0 - 1.0 / g) ** rows) if expected_rows is not None else g
    covered = min(m, -(-rows // tm) * tm)
    visits = min(-(-m // tm) + g - 1, -(-rows // tm) + max(int(active) - 1, 0))
    per_group = k * n + 4 * -(-k // 128) * -(-n // 128)
    weight = n_w * (active if tiles_k == 1 else max(active, visits)) * per_group
    if tiles_k == 1:
        x_rows = covered if covered <= tm else tiles_n * covered
    else:
        x_rows = tiles_n * min(m, rows + int(active) * tm)
    out_rows = 2 * rows - min(overwrites, rows) + zeros if scatter else covered
    acts = (tiles_n * rows if gather else x_rows) * k * itemsize + out_rows * n * itemsize
    return pl.CostEstimate(flops=2 * n_w * rows * k * n, transcendentals=rows * n if n_w == 2 else 0,
                           bytes_accessed=int(weight + acts))


@functools.partial(jax.jit, static_argnames=("block", "tm", "tk", "tn", "interpret", "expected_rows", "zero_tail"))
def fp8_grouped_matmul(
    x: jax.Array,
    q: jax.Array,
    scale: jax.Array,
    group_sizes: jax.Array,
    layer: jax.Array | int | None = None,
    *,
    block: tuple[int, int] = (128, 128),
    tm: int = 128,
    tk: int = 2048,
    tn: int = 1024,
    interpret: bool = False,
    expected_rows: int | None = None,
    zero_tail: bool = True,
) -> jax.Array:
    """``ragged_dot(x, q * scale, group_sizes)`` without a dequantised copy of ``q`` (module docstring).

    Args:
        x: ``[M, K]`` rows sorted by group.
        q: ``[G, K, N]`` float8_e4m3fn, or ``[L, G, K, N]`` (a stack of layers) with ``layer`` given: the
            kernel reads layer ``layer`` in place (a sliced operand would be copied by XLA first).
        scale: ``[G, ceil(K / b0), ceil(N / b1)]`` float32 (that layer's).
        group_sizes: ``[G]`` int32.
        layer: int32 scalar (may be traced) for a 4-D ``q``; None for a 3-D one.
        block: ``(b0, b1)`` quantisation block; each must divide 128 or be a multiple of it.
        tm, tk, tn: tile targets (rounded to the block and to the operand dims).
        interpret: Pallas TPU interpret mode (CPU tests).
        expected_rows: rows the groups are expected to cover (for XLA's cost model only: weights of
            groups without rows are not read); default M.
        zero_tail: zero the rows past the groups (see Returns).

    Returns:
        ``[M, N]`` in ``x.dtype`` (f32 accumulation); rows past ``sum(group_sizes)`` are 0, or undefined
        with ``zero_tail=False`` (for callers whose groups cover every row or that drop those rows: the
        zeroing is a pass over the whole output).

    Raises:
        ValueError: a shape mismatch or a block size the tiling cannot honour.
    """
    return _grouped_call(x, [(q, scale)], group_sizes, layer, None, block=block, tm=tm, tk=tk, tn=tn,
                         interpret=interpret, expected_rows=expected_rows, zero_tail=zero_tail)


@functools.partial(jax.jit, static_argnames=("block", "tm", "tk", "tn", "interpret", "expected_rows", "zero_tail"))
def fp8_grouped_swiglu(
    x: jax.Array,
    q_gate: jax.Array,
    scale_gate: jax.Array,
    q_up: jax.Array,
    scale_up: jax.Array,
    group_sizes: jax.Array,
    layer: jax.Array | int | None = None,
    row_scale: jax.Array | None = None,
    row_ids: jax.Array | None = None,
    *,
    block: tuple[int, int] = (128, 128),
    tm: int = 128,
    tk: int = 2048,
    tn: int = 1024,
    interpret: bool | pltpu.InterpretParams = False,
    expected_rows: int | None = None,
    zero_tail: bool = True,
) -> jax.Array:
    """``silu(x @ w_gate) * (x @ w_up) * row_scale[:, None]`` per group in one pass (module docstring).

    With ``row_ids``, row ``r`` of the input is ``x[row_ids[r]]``, gathered inside the kernel: each visit's
    rows are read from HBM by one DMA each while the previous visit's matmul runs, so no gathered ``[M, K]``
    copy is written. ``x`` is then the ``[S, K / 128, 128]`` row source (each row its own run of tiles, as
    for the scatter accumulator) and the K tile is all of K.

    Args:
        x: ``[M, K]`` rows sorted by group, or the ``[S, K // 128, 128]`` source of ``row_ids``.
        q_gate, q_up: ``[G, K, N]`` float8_e4m3fn, or ``[L, G, K, N]`` stacks with ``layer`` given.
        scale_gate, scale_up: ``[G, ceil(K / b0), ceil(N / b1)]`` float32.
        group_sizes: ``[G]`` int32.
        layer: int32 scalar for 4-D stacks; None for 3-D ones.
        row_scale: ``[M]`` float32 multiplying each row's result (in float32, before the cast), or None.
        row_ids: ``[M]`` int32 rows of ``x`` (rows past the groups are not read), or None.
        block, tm, tk, tn, interpret, expected_rows, zero_tail: as :func:`fp8_grouped_matmul` (and
            :func:`fp8_grouped_matmul_scatter_add` for ``interpret``).

    Returns:
        ``[M, N]`` in ``x.dtype``: the product of each row's two float32 accumulators' SwiGLU; rows past the
        groups as in :func:`fp8_grouped_matmul`.

    Raises:
        ValueError: a shape mismatch (the two weights must have one shape) or an unusable block size.
    """
    if q_gate.shape != q_up.shape or scale_gate.shape != scale_up.shape:
        raise ValueError(f"gate {q_gate.shape} / {scale_gate.shape} and up {q_up.shape} / {scale_up.shape} differ")
    m = x.shape[0] if row_ids is None else row_ids.shape[0]
    if row_scale is not None and row_scale.shape != (m,):
        raise ValueError(f"row_scale {row_scale.shape} is not [{m}]")
    if row_ids is not None and (x.ndim != 3 or x.shape[2] != 128 or row_ids.ndim != 1):
        raise ValueError(f"x {x.shape} is not a [S, K // 128, 128] row source, or row_ids {row_ids.shape} not [M]")
    return _grouped_call(x, [(q_gate, scale_gate), (q_up, scale_up)], group_sizes, layer, row_scale, block=block,
                         tm=tm, tk=tk, tn=tn, interpret=interpret, expected_rows=expected_rows, zero_tail=zero_tail,
                         gather=row_ids)


@functools.partial(jax.jit, static_argnames=("num_rows", "block", "tm", "tk", "interpret", "expected_rows",
                                             "expected_overwrites", "expected_zero_rows"), donate_argnames=("acc",))
def fp8_grouped_matmul_scatter_add(
    x: jax.Array,
    q: jax.Array,
    scale: jax.Array,
    group_sizes: jax.Array,
    dest: jax.Array,
    acc: jax.Array | None,
    layer: jax.Array | int | None = None,
    overwrite: jax.Array | None = None,
    zero_rows: jax.Array | None = None,
    *,
    num_rows: int | None = None,
    block: tuple[int, int] = (128, 128),
    tm: int = 128,
    tk: int = 2048,
    interpret: bool | pltpu.InterpretParams = False,
    expected_rows: int | None = None,
    expected_overwrites: int = 0,
    expected_zero_rows: int = 0,
) -> jax.Array:
    """``acc[dest[r]] += x[r] @ w[group(r)]`` for every row ``r`` the groups cover (module docstring), or
    ``=`` where ``overwrite[r]``.

    Args:
        x: ``[M, K]`` rows sorted by group; q, scale, group_sizes, layer: as :func:`fp8_grouped_matmul`.
        dest: ``[M]`` int32 accumulator row of each x row, in ``[0, R)``; distinct within a group (rows past
            the groups are not read).
        acc: ``[R, N // 128, 128]``, the accumulator (donated: updated in place). Each product is rounded to
            ``acc.dtype`` and added in float32, as ``acc.at[dest].add(product.astype(acc.dtype))``; a row's
            products from several groups are added in group order. None: a new ``[num_rows, N // 128, 128]``
            accumulator in ``x.dtype`` that nothing zeroes first: defined only in the rows the call writes
            (an ``overwrite`` row before any add, ``zero_rows``).
        overwrite: ``[M]`` bool or None: row ``r``'s product replaces ``acc[dest[r]]`` (not read: a caller
            that knows the row is still zero, its first write, saves the read).
        zero_rows: ``[Z]`` int32 or None: rows set to zero (-1 entries are skipped), one DMA each spread over
            the visits; none of them may be a destination of a covered row.
        num_rows: R when ``acc`` is None.
        block, tm, tk, expected_rows: as :func:`fp8_grouped_matmul` (the N tile is all of N).
        expected_overwrites, expected_zero_rows: XLA's cost model only: covered rows expected to have
            ``overwrite`` set, and real entries of ``zero_rows``.
        interpret: as :func:`fp8_grouped_matmul`, or the ``pltpu.InterpretParams`` to interpret with (tests:
            DMAs executed only when waited for, so a missing wait shows as a wrong sum).

    Returns:
        The updated ``acc``.

    Raises:
        ValueError: a shape mismatch, N not a multiple of 128, or an unusable block size.
    """
    n = q.shape[-1]
    if acc is None:
        if num_rows is None:
            raise ValueError("a new accumulator (acc None) needs num_rows")
        acc_shape = (num_rows, n // 128, 128)
    else:
        acc_shape = acc.shape
    if n % 128 or acc_shape[1:] != (n // 128, 128):
        raise ValueError(f"acc {acc_shape} is not [R, {n} // 128, 128] (N must be a multiple of 128)")
    if dest.shape != (x.shape[0],):
        raise ValueError(f"dest {dest.shape} is not [{x.shape[0]}]")
    if overwrite is not None:
        if overwrite.shape != dest.shape:
            raise ValueError(f"overwrite {overwrite.shape} is not [{x.shape[0]}]")
        dest = jnp.where(overwrite, -1 - dest, dest)  # the kernel's encoding (_scatter_add_rows)
    counts = (expected_overwrites if overwrite is not None else 0, expected_zero_rows if zero_rows is not None else 0)
    return _grouped_call(x, [(q, scale)], group_sizes, layer, None, block=block, tm=tm, tk=tk, tn=n,
                         interpret=interpret, expected_rows=expected_rows, zero_tail=False,
                         scatter=(dest, acc, acc_shape[0], zero_rows), scatter_counts=counts)


def _grouped_call(
    x: jax.Array, weights: list[tuple[jax.Array, jax.Array]], group_sizes: jax.Array, layer: Any,
    row_scale: jax.Array | None, *, block: tuple[int, int], tm: int, tk: int, tn: int,
    interpret: bool | pltpu.InterpretParams, expected_rows: int | None, zero_tail: bool,
    scatter: tuple[jax.Array, jax.Array | None, int, jax.Array | None] | None = None, gather: jax.Array | None = None,
    scatter_counts: tuple[int, int] = (0, 0),
) -> jax.Array:
    """The pallas_call of :func:`fp8_grouped_matmul` (one weight), :func:`fp8_grouped_swiglu` (two; ``gather``
    = its row ids) and :func:`fp8_grouped_matmul_scatter_add` (one, ``scatter = (dest, acc or None, rows,
    zero_rows or None)``; ``scatter_counts``: its expected overwrites and zeroed rows, for the cost)."""
    if scatter is not None and gather is not None:
        raise ValueError("a call gathers its rows or scatters its products, not both")
    q, scale = weights[0]
    if q.ndim == 3:
        weights = [(w[None], s) for w, s in weights]
        q, layer = q[None], 0
    elif layer is None:
        raise ValueError("a stacked q [L, G, K, N] needs its layer index")
    layer_arr = jnp.reshape(jnp.asarray(layer, jnp.int32), (1,))
    m, k_dim = (x.shape[0], x.shape[1]) if gather is None else (gather.shape[0], x.shape[1] * x.shape[2])
    if gather is not None:
        tk = k_dim  # whole rows: one DMA each
    _, g, kq, n = q.shape
    b0, b1 = block
    if kq != k_dim or scale.shape != (g, -(-k_dim // b0), -(-n // b1)):
        raise ValueError(f"x {x.shape}, q {q.shape}, scale {scale.shape} do not match (block {block})")
    unit_k, unit_n = max(b0, 128), max(b1, 128)
    if unit_k % b0 or unit_n % b1:
        raise ValueError(f"block {block}: each side must divide 128 or be a multiple of it")
    tk = _tile(k_dim, max(tk, unit_k) // unit_k * unit_k, unit_k)
    tn = _tile(n, max(tn, unit_n) // unit_n * unit_n, unit_n)
    tm = _tile(m, tm, 16)
    tiles_m, tiles_k, tiles_n = -(-m // tm), -(-k_dim // tk), -(-n // tn)
    num_visits = tiles_m + g - 1
    group, tile, starts, ends, total = _visits(group_sizes, tm, tiles_m, num_visits)
    # Scale per (group, N tile): [K blocks padded to the K tiles, tn // b1] (tiny; padding reads as 1).
    kb_pad, nb_pad = tiles_k * tk // b0, tiles_n * tn // b1

    def scale_tiles(sc: jax.Array) -> jax.Array:
        sp = jnp.pad(sc.astype(jnp.float32), ((0, 0), (0, kb_pad - sc.shape[1]), (0, nb_pad - sc.shape[2])),
                     constant_values=1.0)
        return sp.reshape(g, kb_pad, tiles_n, tn // b1).transpose(0, 2, 1, 3)  # [G, N tiles, Kb, tn // b1]

    n_w = len(weights)
    kernel = functools.partial(_kernel, tm=tm, tk=tk, tn=tn, k_dim=k_dim, block=(b0, b1), swiglu=n_w == 2,
                               row_scale=row_scale is not None, scatter=scatter is not None,
                               gather=gather is not None, acc_in=scatter is not None and scatter[1] is not None,
                               zeroing=scatter is not None and scatter[3] is not None)
    vmem = _vmem(tm, tk, tn, n_w, x.dtype.itemsize, k_dim)
    weight_specs = [
        pl.BlockSpec((None, None, tk, tn), lambda j, t, kk, lay, gr, ti, *_: (lay[0], gr[t], kk, j)),
        pl.BlockSpec((1, 1, kb_pad, tn // b1), lambda j, t, kk, lay, gr, ti, *_: (gr[t], j, 0, 0)),
    ]
    operands: list[jax.Array] = []
    for wq, ws in weights:
        operands += [wq, scale_tiles(ws)]
    in_specs = [pl.BlockSpec((tm, tk), lambda j, t, kk, lay, gr, ti, *_: (ti[t], kk)), *weight_specs * n_w]
    if row_scale is not None:
        in_specs.append(pl.BlockSpec((tm, 1), lambda j, t, kk, lay, gr, ti, *_: (ti[t], 0)))
        operands.append(row_scale.astype(jnp.float32)[:, None])
    # Row ids (gather) and destinations (scatter) are the scalar addresses of row DMAs: in SMEM, as
    # [row tiles, tm] in blocks of 8 row tiles (Mosaic's block rule for a 2-D block; a 1-D block of tm rows
    # is refused); the kernel reads row (tile & 7) of its block.
    eights = -(-tiles_m // 8) * 8

    def per_tile(v: jax.Array) -> jax.Array:
        return jnp.pad(v.astype(jnp.int32), (0, eights * tm - m)).reshape(eights, tm)

    def tile_block(nxt: bool) -> pl.BlockSpec:  # this visit's tile, or the next real visit's
        def index(j, t, kk, lay, gr, ti, st, en, tot):
            return (ti[jnp.where(t + 1 < tot[0], t + 1, 0) if nxt else t] >> 3, 0)

        return pl.BlockSpec((8, tm), index, memory_space=pltpu.SMEM)

    if gather is not None:
        # The row source stays in HBM; the row ids of this visit's tile and of the next visit's.
        in_specs[0] = pl.BlockSpec(memory_space=pl.ANY)
        in_specs += [tile_block(False), tile_block(True)]
        operands += [per_tile(gather)] * 2
    scratch = [pltpu.VMEM((tm, tn), jnp.float32) for _ in range(n_w)]
    out_spec = pl.BlockSpec((tm, tn), lambda j, t, kk, lay, gr, ti, *_: (ti[t], j))
    out_shape = jax.ShapeDtypeStruct((m, n), x.dtype)
    aliases: dict[int, int] = {}
    if scatter is not None:
        dest, acc, acc_rows, zero_rows = scatter
        acc_dtype = x.dtype if acc is None else acc.dtype
        in_specs.append(tile_block(False))
        operands.append(per_tile(dest))
        if acc is not None:
            in_specs.append(pl.BlockSpec(memory_space=pl.ANY))
            operands.append(acc)
            aliases = {6 + 1 + len(operands) - 1: 0}  # scalar prefetch, x, then the operands: acc is the last
        if zero_rows is not None:
            # Spread over the visits: visit t zeroes row (t & 7) of its 8-visit SMEM block (as per_tile).
            per_visit = max(1, -(-zero_rows.shape[0] // num_visits))
            visits8 = -(-num_visits // 8) * 8
            table = jnp.pad(zero_rows.astype(jnp.int32), (0, visits8 * per_visit - zero_rows.shape[0]),
                            constant_values=-1).reshape(visits8, per_visit)
            in_specs.append(pl.BlockSpec((8, per_visit), lambda j, t, kk, *_: (t >> 3, 0), memory_space=pltpu.SMEM))
            operands.append(table)
        row_shape = (n // 128, 128)
        out_spec, out_shape = pl.BlockSpec(memory_space=pl.ANY), jax.ShapeDtypeStruct((acc_rows, *row_shape), acc_dtype)
        scratch += [pltpu.VMEM((tm, *row_shape), acc_dtype), pltpu.VMEM((1, *row_shape), acc_dtype),
                    pltpu.SemaphoreType.DMA((3,))]
        vmem += 2 * tm * tn * jnp.dtype(acc_dtype).itemsize  # the row buffer (rows padded to whole sublane tiles)
    if gather is not None:
        scratch += [pltpu.VMEM((2, tm, *x.shape[1:]), x.dtype), pltpu.VMEM((tm, k_dim), jnp.float32),
                    pltpu.SemaphoreType.DMA((2,))]
        vmem += 2 * tm * k_dim * x.dtype.itemsize + tm * k_dim * 4
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=6,
            grid=(tiles_n, num_visits, tiles_k),
            in_specs=in_specs,
            out_specs=out_spec,
            scratch_shapes=scratch,
        ),
        out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=pltpu.CompilerParams(
            # A scatter's visits read and write HBM rows another visit may touch, and a gather's prefetch runs
            # from one N tile into the next: one sequential walk (no split of the N tiles across cores).
            dimension_semantics=("parallel" if scatter is None and gather is None else "arbitrary", "arbitrary",
                                 "arbitrary"),
            vmem_limit_bytes=int(min(max(2 * vmem, 32 * 2**20), 100 * 2**20)),
        ),
        interpret=interpret if isinstance(interpret, pltpu.InterpretParams) else (
            pltpu.InterpretParams() if interpret else False),
        cost_estimate=_cost(m, k_dim, n, g, x.dtype.itemsize, tm, expected_rows, n_w, scatter is not None,
                            gather is not None, tiles_n, *scatter_counts, tiles_k=tiles_k),
    )(layer_arr, group, tile, starts, ends, total, x, *operands)
    if scatter is not None:
        return out
    # Row tiles no group visits are never written.
    if not zero_tail:
        return out
    return jnp.where(jnp.arange(m)[:, None] < total_rows(group_sizes), out, 0).astype(x.dtype)


def total_rows(group_sizes: jax.Array) -> jax.Array:
    """Rows the groups cover (``sum(group_sizes)``), int32 scalar."""
    return jnp.sum(group_sizes.astype(jnp.int32))
