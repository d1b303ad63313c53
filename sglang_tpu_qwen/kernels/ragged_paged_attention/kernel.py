"""Batched ragged paged attention (Pallas TPU kernel) over head-major pages: every sequence of a step in one call.

Algorithm: PagedAttention (Kwon et al., SOSP 2023) with the online softmax of FlashAttention (Dao et al.,
NeurIPS 2022). The pools are head-major (head_major.py): ``[L, num_pages, nkv, page_size, hd]``, so one
page of all heads is one contiguous ``[nkv, page_size, hd]`` block whose minor dims fill whole
``(sublane, 128)`` tiles. Two steps per call:

1. The step's new K/V go into their pages by XLA, a tile-aligned block of tokens at a time (:func:`write_new_kv`):
   the blocks a row's new tokens touch are gathered, merged with the new tokens and copied back by a Pallas
   copy (one DMA per block, the pool aliased in place). An XLA scatter of single tokens makes XLA move the pool to
   a layout with the token dim outside the tile, copying both pools twice per call (measured on v5e: 4x
   slower decode); an XLA scatter of whole pages keeps bf16 pools in place but still copies FP8 ones.
2. The kernel walks the rows of a grid step and, for each, its key blocks of ``block_keys`` tokens (``kv_pages``
   pages, one DMA per page per pool), keeping a running max, sum and float32 accumulator per query row.
   The next key block is fetched while this one computes, across row boundaries too (the first block of the
   next row with keys loads during the last block of this one), so decode streams the KV without bubbles.

Causal masking is by absolute position (the query at position ``p`` sees keys ``< min(kv_len, p + 1)``);
key blocks past the query block's last visible key are not fetched.

Layout of the step. The scheduler pads a step to ``[B, T]``, so the ragged batch is rows ``b`` with
``q_lens[b]`` valid tokens each. Shapes:

    q              [B, T, nq, hd]       queries (RoPE applied), any float dtype
    k_new, v_new   [B, T, nkv, hd]      this step's keys / values
    k_cache, v_cache [L, num_pages, nkv, page_size, hd]   head-major pools of all attention layers
    layer          int32 scalar         attention layer to use
    q_lens         [B] int32            new tokens per row (0: padding row; nothing written, output 0)
    kv_lens        [B] int32            context length after this step (prefix + q_len)
    page_table     [B, P] int32         page of key position j is page_table[b, j // page_size]

GQA: the ``G = nq / nkv`` query heads of one KV head are stacked into the rows of one matmul
(``[q_block * G, hd] x [hd, keys]``), so a K/V page is read once for all of its query heads.

Grid ``(B / rows_per_step, T / q_block)``, both "arbitrary" (one TensorCore walks them in order, which the
cross-row prefetch relies on). Decode and short steps (``T x G <= short_q_rows``, an MTP verify): all T tokens in
one query block, ``decode_seqs / T`` rows per grid step. Longer steps: one row per grid step, ``prefill_q`` query
tokens per step (at most ``prefill_rows / G``). A key block's pages past the row's last visible key are not
fetched. Scalar metadata (layer, lengths, flattened page table, FP8 scales) is scalar-prefetched into SMEM.

FP8 pages (kv_quant.py): the new K/V are quantised (``x / scale``, saturated) before the write; reads upcast
each page tile to the query dtype in VMEM (exact) and apply the scales to the float32 scores (K) and the
output (V). On a TPU an FP8 page must be a multiple of 32 tokens (the 8-bit sublane tile).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from sglang_tpu_qwen.kernels.ragged_paged_attention.block_sizes import INTERPRET, BlockSizes, block_sizes_for
from sglang_tpu_qwen.kernels.ragged_paged_attention.kv_quant import is_fp8, quantize_kv, scale_or_one
from sglang_tpu_qwen.utils.mxu_precision import operand_precision

# Integer division in the kernel uses lax.div / lax.rem (operands are >= 0): jnp's floor division lowers
# through `sign`, whose Mosaic rule asks the *local* device for its TPU generation, which breaks deviceless AOT.
_MASK = -1e30  # finite: a fully masked row must not turn into NaN via (-inf) - (-inf)
# Rows of a (sublane, 128) VMEM tile by element bytes: a page's [page_size, hd] block must fill whole tiles.
_SUBLANE_TILE = {4: 8, 2: 16, 1: 32}


def _kernel(
    layer_ref, qlen_ref, kvlen_ref, pt_ref, scale_ref,  # scalar prefetch (SMEM)
    q_ref, _kc_in, _vc_in,  # inputs (the caches stay in HBM)
    o_ref, kc_hbm, vc_hbm,  # outputs (the caches are aliased to their inputs)
    kbuf, vbuf, sem, m_ref, l_ref, acc_ref,  # scratch
    *, rows_per_step: int, q_block: int, groups: int, page_size: int, kv_pages: int, pages_per_seq: int,
    sm_scale: float, fp8: bool,
):
    i, j = pl.program_id(0), pl.program_id(1)
    layer = layer_ref[0]
    nkv = q_ref.shape[1]
    rows = q_block * groups
    keys = kv_pages * page_size
    q_start = j * q_block
    # FP8 pages: the K scale folds into the score scale, the V scale multiplies the output (module docstring).
    score_scale, out_scale = (sm_scale * scale_ref[0], scale_ref[1]) if fp8 else (sm_scale, None)

    def row_of(s):
        return i * rows_per_step + s

    def kv_end_of(s):
        """Keys row s's query block j can see: its last query's position + 1, at most the context."""
        b = row_of(s)
        q_len, kv_len = qlen_ref[b], kvlen_ref[b]
        return jnp.minimum(kv_len, kv_len - q_len + q_start + q_block)

    def n_blocks(s):
        """Key blocks row s's query block j reads (0 for padding rows and query blocks past q_len)."""
        return jnp.where(q_start < qlen_ref[row_of(s)], jax.lax.div(kv_end_of(s) + keys - 1, keys), 0)

    def copies(s, kb, slot):
        """(live, DMA) pairs of row s's key block kb into buffer slot (0/1): one per page per pool.

        Only pages holding visible keys are live (started and waited): a block of ``kv_pages`` pages
        usually overhangs a row's last page (576 keys fill 9 of a 1,024-key block's 16 pages of 64)."""
        b = row_of(s)
        live_pages = jax.lax.div(kv_end_of(s) + page_size - 1, page_size)
        cps = []
        for p in range(kv_pages):
            live = kb * kv_pages + p < live_pages
            col = jnp.minimum(kb * kv_pages + p, pages_per_seq - 1)
            page = pt_ref[b * pages_per_seq + col]
            cps.append((live, pltpu.make_async_copy(kc_hbm.at[layer, page], kbuf.at[slot, p], sem.at[slot, 0])))
            cps.append((live, pltpu.make_async_copy(vc_hbm.at[layer, page], vbuf.at[slot, p], sem.at[slot, 1])))
        return cps

    def start(cps):
        for live, cp in cps:
            pl.when(live)(cp.start)

    def wait(cps):  # a wait needs only the descriptor's shape and semaphore
        for live, cp in cps:
            pl.when(live)(cp.wait)

    def next_row_with_keys(s0):
        """The first row >= s0 of this grid step with key blocks (rows_per_step when none)."""
        def empty(s):
            return (s < rows_per_step) & (n_blocks(jnp.minimum(s, rows_per_step - 1)) == 0)
        return jax.lax.while_loop(empty, lambda s: s + 1, s0)

    first = next_row_with_keys(0)

    @pl.when(first < rows_per_step)
    def _prefetch_first():
        start(copies(first, 0, 0))

    def one_row(s, done):
        """Attend row s; ``done`` counts the key blocks of this grid step so far (its parity is the slot)."""
        b = row_of(s)
        q_len, kv_len = qlen_ref[b], kvlen_ref[b]
        # Absolute position of each query row (row r holds token r // G of the block).
        q_pos = kv_len - q_len + q_start + jax.lax.div(jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0), groups)
        nb = n_blocks(s)
        kv_end = kv_end_of(s)
        following = next_row_with_keys(s + 1)
        m_ref[...] = jnp.full(m_ref.shape, _MASK, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

        def key_block(kb, done):
            slot = jax.lax.rem(done, 2)

            @pl.when(kb + 1 < nb)
            def _prefetch_next_block():
                start(copies(s, kb + 1, 1 - slot))

            @pl.when((kb + 1 == nb) & (following < rows_per_step))
            def _prefetch_next_row():
                start(copies(jnp.minimum(following, rows_per_step - 1), 0, 1 - slot))

            wait(copies(s, kb, slot))
            key = kb * keys + jax.lax.broadcasted_iota(jnp.int32, (1, keys), 1)
            mask = (key < kv_len) & (key <= q_pos)  # [rows, keys]
            key_ok = (kb * keys + jax.lax.broadcasted_iota(jnp.int32, (keys, 1), 0)) < kv_end
            for h in range(nkv):
                q = q_ref[s, h]  # [rows, hd]
                k = kbuf[slot, :, h].reshape(keys, -1).astype(q.dtype)  # FP8: exact upcast in VMEM
                # Values past the visible keys are zeroed: unfetched, stale or trash-page contents must not
                # reach a row as NaN * 0 (masked keys need nothing: their scores are replaced).
                v = jnp.where(key_ok, vbuf[slot, :, h].reshape(keys, -1).astype(q.dtype), 0)
                sc = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=operand_precision(q.dtype),
                                         preferred_element_type=jnp.float32)
                sc = jnp.where(mask, sc * score_scale, _MASK)
                m_prev = m_ref[h]  # [rows, 128], lanes equal
                m_new = jnp.maximum(m_prev, jnp.max(sc, axis=1, keepdims=True))
                pr = jnp.exp(sc - m_new[:, :1])
                alpha = jnp.exp(m_prev - m_new)
                l_ref[h] = alpha * l_ref[h] + jnp.sum(pr, axis=1, keepdims=True)
                pv = jnp.dot(pr.astype(v.dtype), v, precision=operand_precision(v.dtype),
                             preferred_element_type=jnp.float32)
                acc_ref[h] = acc_ref[h] * alpha[:, :1] + pv
                m_ref[h] = m_new
            return done + 1

        done = jax.lax.fori_loop(0, nb, key_block, done)
        for h in range(nkv):
            denom = l_ref[h][:, :1]
            out = acc_ref[h] / jnp.where(denom == 0.0, 1.0, denom)
            if out_scale is not None:
                out = out * out_scale
            o_ref[s, h] = out.astype(o_ref.dtype)
        return done

    jax.lax.fori_loop(0, rows_per_step, one_row, jnp.int32(0))


def write_block_rows(page_size: int, dtype) -> int:
    """Token rows of one write block: the dtype's sublane tile where it divides the page, else the page.

    A block is one ``[block_rows, hd]`` slice of every KV head of a page: whole tiles, so a DMA moves it without
    relaying, and a decode row rewrites 16 bf16 tokens instead of its whole page of 64 (measured on v5e at 256
    rows: the page-sized merge took 0.27 ms a step, 2% of it)."""
    tile = _SUBLANE_TILE[jnp.dtype(dtype).itemsize]
    return tile if page_size % tile == 0 else page_size


def write_new_kv(pool: jax.Array, new: jax.Array, layer: jax.Array | int, q_lens: jax.Array, kv_lens: jax.Array,
                 page_table: jax.Array, *, interpret: bool = False) -> jax.Array:
    """Write a step's new keys (or values) into a head-major pool in place, a tile-aligned block at a time.

    Args:
        pool: ``[L, num_pages, nkv, page_size, hd]`` (donated by the caller's jit; updated in place).
        new: ``[B, T, nkv, hd]`` already in the pool dtype (``kv_quant.quantize_kv``).
        layer: attention-layer index (int32 scalar, may be traced).
        q_lens, kv_lens: ``[B]`` int32 new tokens and context length after the step.
        page_table: ``[B, P]`` int32.
        interpret: run the block copy in Pallas TPU interpret mode (CPU).

    Returns:
        The pool with token ``kv_len - q_len + t`` of row ``b`` set to ``new[b, t]`` for ``t < q_len``; no
        other real page changes. The blocks (:func:`write_block_rows` tokens of every head) a row's new tokens
        touch are taken from their gathered pages (XLA fuses the two into a gather of the blocks), merged with the
        new tokens and copied back. The copy has a fixed count (``B x`` the most blocks T tokens touch): padding
        rows' and unused slots' copies go to trash page 0, which no row reads. Every row's touched pages are its
        own (the radix cache shares only full pages), so the real copies never collide.

    Cost: a decode step rewrites one block per row (16 tokens of a bf16 pool). A write of single tokens is not
    enough: XLA's scatter of them copies the whole pool to another layout and back.
    """
    b, t, nkv, hd = new.shape
    page_size = pool.shape[3]
    rows = write_block_rows(page_size, pool.dtype)
    touched = (t + rows - 2) // rows + 1  # most blocks T consecutive tokens can touch
    prefix = (kv_lens - q_lens).astype(jnp.int32)
    blocks = prefix[:, None] // rows + jnp.arange(touched, dtype=jnp.int32)[None, :]  # [B, n] global block index
    live = (blocks <= ((kv_lens - 1) // rows)[:, None]) & (q_lens[:, None] > 0)
    per_page = page_size // rows
    cols, subs = blocks // per_page, blocks % per_page  # page column, block within the page
    pages = jnp.take_along_axis(page_table.astype(jnp.int32), jnp.clip(cols, 0, page_table.shape[1] - 1), axis=1)
    layer = jnp.asarray(layer, jnp.int32)

    # Whole pages are gathered, then the blocks taken from them: a gather of blocks straight from the pool (an
    # index on its tiled second-minor dim) makes XLA copy the pool to another layout (deviceless compile).
    old = pool[layer, pages].reshape(b, touched, nkv, per_page, rows, hd)
    old = jnp.take_along_axis(old, subs[:, :, None, None, None, None], axis=3)[:, :, :, 0]
    tok = blocks[:, :, None] * rows + jnp.arange(rows, dtype=jnp.int32) - prefix[:, None, None]
    fresh = (tok >= 0) & (tok < q_lens[:, None, None])  # [B, n, rows]
    picked = jnp.take_along_axis(new, jnp.clip(tok, 0, t - 1).reshape(b, -1)[:, :, None, None], axis=1)
    picked = picked.reshape(b, touched, rows, nkv, hd).transpose(0, 1, 3, 2, 4)
    merged = jnp.where(fresh[:, :, None, :, None], picked, old)
    # Unused writes go to trash page 0, which no row reads.
    pages, subs = jnp.where(live, pages, 0), jnp.where(live, subs, 0)
    return _copy_blocks(pool, merged.reshape(b * touched, nkv, rows, hd), layer, pages.reshape(-1),
                        (subs * rows).reshape(-1), interpret=interpret)


def _copy_blocks_kernel(layer_ref, pages_ref, starts_ref, merged_hbm, _pool_in, pool_hbm, sem):
    """DMA ``merged[i]`` to rows ``starts[i]:`` of page ``pages[i]`` of the layer, all copies in flight at once."""
    layer = layer_ref[0]
    rows = merged_hbm.shape[2]

    def copy(i):
        first = pl.multiple_of(starts_ref[i], rows)
        return pltpu.make_async_copy(merged_hbm.at[i], pool_hbm.at[layer, pages_ref[i], :, pl.ds(first, rows)],
                                     sem.at[0])

    def start(i, c):
        copy(i).start()
        return c

    def wait(i, c):
        copy(i).wait()
        return c

    n = merged_hbm.shape[0]
    jax.lax.fori_loop(0, n, start, 0)
    jax.lax.fori_loop(0, n, wait, 0)


def _copy_blocks(pool: jax.Array, merged: jax.Array, layer: jax.Array, pages: jax.Array, starts: jax.Array, *,
                 interpret: bool) -> jax.Array:
    """``pool`` (aliased, in place) with rows ``starts[i]:`` of page ``pages[i]`` of ``layer`` set to
    ``merged[i] [nkv, rows, hd]``.

    A Pallas copy rather than an XLA scatter: XLA's scatter wants an FP8 pool tiled (8, 128) where the
    pool and the attention kernel use (32, 128), and copied both pools to that layout and back every call."""
    return pl.pallas_call(
        _copy_blocks_kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3, grid=(1,),
            in_specs=[pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=pl.BlockSpec(memory_space=pl.ANY),
            scratch_shapes=[pltpu.SemaphoreType.DMA((1,))]),
        out_shape=jax.ShapeDtypeStruct(pool.shape, pool.dtype),
        input_output_aliases={4: 0},  # operands count the 3 scalar-prefetch ones: the pool is operand 4
        interpret=pltpu.InterpretParams() if interpret else False,
        # XLA cannot see in: the traffic is the merged blocks read and written once, not the whole pool.
        cost_estimate=pl.CostEstimate(flops=0, transcendentals=0, bytes_accessed=int(2 * merged.nbytes)),
    )(jnp.reshape(layer, (1,)), pages.astype(jnp.int32), starts.astype(jnp.int32), merged, pool)


@functools.partial(jax.jit, static_argnames=("sm_scale", "block_sizes", "interpret"), donate_argnums=(3, 4))
def ragged_paged_attention(
    q: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    layer: jax.Array | int,
    q_lens: jax.Array,
    kv_lens: jax.Array,
    page_table: jax.Array,
    *,
    k_scale: jax.Array | float | None = None,
    v_scale: jax.Array | float | None = None,
    sm_scale: float | None = None,
    block_sizes: BlockSizes | None = None,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Write a step's K/V into the head-major paged cache and attend every sequence of the step (module docstring).

    Args:
        q: ``[B, T, nq, hd]`` queries; ``nq`` a multiple of ``nkv``.
        k_new, v_new: ``[B, T, nkv, hd]`` new keys / values (stored as ``kv_quant.quantize_kv`` gives them).
        k_cache, v_cache: ``[L, num_pages, nkv, page_size, hd]`` (head_major.py), donated and updated in place;
            float32, bfloat16 or float8_e4m3fn.
        layer: attention-layer index into the caches (int32 scalar, may be traced).
        q_lens: ``[B]`` int32 valid new tokens per row (``<= T``).
        kv_lens: ``[B]`` int32 context length including the new tokens.
        page_table: ``[B, P]`` int32 page ids.
        k_scale, v_scale: this layer's FP8 dequantisation scales (float32 scalars, may be traced; None = 1.0);
            ignored for other cache dtypes.
        sm_scale: softmax scale, default ``hd ** -0.5``.
        block_sizes: tiling; default ``block_sizes_for()`` for the current device (``block_sizes.INTERPRET`` in
            interpret mode).
        interpret: run in Pallas TPU interpret mode (``pltpu.InterpretParams()``), for CPU.

    Returns:
        ``(out [B, T, nq, hd] in q.dtype, k_cache, v_cache)``. Rows ``t >= q_lens[b]`` of ``out`` are finite
        but meaningless (0 for rows with ``q_lens[b] == 0``); the K/V of padded tokens reaches no real page
        (only trash page 0, as the reference's does).

    Raises:
        ValueError: when ``nq`` is not a multiple of ``nkv``, the caches are not head-major for ``nkv`` heads of
            ``hd``, one is FP8 and the other not, or (compiled for a TPU) the page size is not a multiple of the
            dtype's sublane tile (8 float32, 16 bfloat16, 32 FP8).
    """
    b, t, nq, hd = q.shape
    nkv = k_new.shape[2]
    if k_cache.ndim != 5 or k_cache.shape[2] != nkv or k_cache.shape[4] != hd or v_cache.shape != k_cache.shape:
        raise ValueError(f"caches {k_cache.shape}, {v_cache.shape} are not head-major [L, N, {nkv}, page, {hd}]")
    if nq % nkv:
        raise ValueError(f"query heads ({nq}) must be a multiple of KV heads ({nkv})")
    fp8 = is_fp8(k_cache.dtype)
    if is_fp8(v_cache.dtype) != fp8:
        raise ValueError(f"K and V caches must both be FP8 or neither: {k_cache.dtype}, {v_cache.dtype}")
    page_size = k_cache.shape[3]
    tile = _SUBLANE_TILE[jnp.dtype(k_cache.dtype).itemsize]
    if not interpret and page_size % tile:
        raise ValueError(f"page size {page_size} is not a multiple of {tile}, the TPU's sublane tile for a "
                         f"{jnp.dtype(k_cache.dtype).name} KV cache: choose --page-size (64 is the TPU default)")
    groups = nq // nkv
    k_cache = write_new_kv(k_cache, quantize_kv(k_new, k_cache.dtype, k_scale), layer, q_lens, kv_lens, page_table,
                           interpret=interpret)
    v_cache = write_new_kv(v_cache, quantize_kv(v_new, v_cache.dtype, v_scale), layer, q_lens, kv_lens, page_table,
                           interpret=interpret)
    bs = block_sizes or (INTERPRET if interpret else block_sizes_for())
    if t * groups <= bs.short_q_rows:
        # Decode and short steps (an MTP verify's k + 1 tokens): every token of a row in one query block, many
        # rows a grid step, so the next row's first keys load while this one computes.
        q_block, rows_per_step = t, min(max(1, bs.decode_seqs // t), b)
    else:
        q_block, rows_per_step = min(bs.prefill_q, t, max(1, bs.prefill_rows // groups)), 1
    pages_per_seq = page_table.shape[1]
    kv_pages = max(1, min(bs.block_keys // page_size, pages_per_seq))
    pad_b, pad_t = (-b) % rows_per_step, (-t) % q_block
    if pad_b or pad_t:
        q = jnp.pad(q, ((0, pad_b), (0, pad_t), (0, 0), (0, 0)))
        q_lens, kv_lens = jnp.pad(q_lens, (0, pad_b)), jnp.pad(kv_lens, (0, pad_b))
        page_table = jnp.pad(page_table, ((0, pad_b), (0, 0)))
    bp, tp = b + pad_b, t + pad_t
    qt = q.reshape(bp, tp, nkv, groups, hd).transpose(0, 2, 1, 3, 4).reshape(bp, nkv, tp * groups, hd)
    scales = jnp.stack([scale_or_one(k_scale), scale_or_one(v_scale)])
    rows = q_block * groups
    kernel = functools.partial(
        _kernel, rows_per_step=rows_per_step, q_block=q_block, groups=groups, page_size=page_size,
        kv_pages=kv_pages, pages_per_seq=pages_per_seq, sm_scale=sm_scale or hd**-0.5, fp8=fp8)
    q_spec = pl.BlockSpec((rows_per_step, nkv, rows, hd), lambda i, j, *_: (i, 0, j, 0))
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    out, k_cache, v_cache = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=5,
            grid=(bp // rows_per_step, tp // q_block),
            in_specs=[q_spec, any_spec, any_spec],
            out_specs=[q_spec, any_spec, any_spec],
            scratch_shapes=[
                pltpu.VMEM((2, kv_pages, nkv, page_size, hd), k_cache.dtype),
                pltpu.VMEM((2, kv_pages, nkv, page_size, hd), v_cache.dtype),
                pltpu.SemaphoreType.DMA((2, 2)),
                pltpu.VMEM((nkv, rows, 128), jnp.float32),
                pltpu.VMEM((nkv, rows, 128), jnp.float32),
                pltpu.VMEM((nkv, rows, hd), jnp.float32),
            ],
        ),
        out_shape=[jax.ShapeDtypeStruct(qt.shape, q.dtype),
                   jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
                   jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype)],
        # Operand indices count the 5 scalar-prefetch operands: k_cache is operand 6, v_cache operand 7.
        input_output_aliases={6: 1, 7: 2},
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("arbitrary", "arbitrary"), vmem_limit_bytes=bs.vmem_limit_bytes),
        interpret=pltpu.InterpretParams() if interpret else False,
        # XLA cannot see in: the traffic is q and the output plus each row's pages of this layer (all P
        # columns: an upper bound, exact for full-context rows), not the whole caches.
        cost_estimate=pl.CostEstimate(
            flops=int(4 * bp * tp * nq * hd * pages_per_seq * page_size), transcendentals=int(
                bp * tp * nq * pages_per_seq * page_size),
            bytes_accessed=int(2 * qt.size * q.dtype.itemsize
                               + 2 * bp * pages_per_seq * page_size * nkv * hd * k_cache.dtype.itemsize)),
    )(
        jnp.reshape(jnp.asarray(layer, jnp.int32), (1,)), q_lens.astype(jnp.int32), kv_lens.astype(jnp.int32),
        page_table.astype(jnp.int32).reshape(-1), scales, qt, k_cache, v_cache,
    )
    out = out.reshape(bp, nkv, tp, groups, hd).transpose(0, 2, 1, 3, 4).reshape(bp, tp, nq, hd)
    return out[:b, :t], k_cache, v_cache
