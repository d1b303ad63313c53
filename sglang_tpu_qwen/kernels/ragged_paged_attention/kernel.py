"""Batched ragged paged attention (Pallas TPU kernel): every sequence of a step in one call.

Algorithm: PagedAttention (Kwon et al., SOSP 2023) with the online softmax of FlashAttention (Dao et al.,
NeurIPS 2022). For each sequence the call first writes the step's new K/V rows into their pages (one DMA
per token, HBM to HBM, into the cache aliased input -> output), then for each query block walks the
sequence's pages ``kv_pages`` at a time (DMA HBM -> VMEM through the page table, double-buffered),
keeping a running max, sum and fp32 accumulator per query row. Causal masking is by absolute position
(the query at position ``p`` sees keys ``< min(kv_len, p + 1)``); pages past the block's last visible key
are not fetched.

Layout. The scheduler pads a step to ``[B, T]`` (B, T powers of two), so the ragged batch is given as rows
``b`` with ``q_lens[b]`` valid tokens each: sequence ``b``'s tokens start at flat offset ``b * T``. This
fixed stride is what makes a query block addressable by a BlockSpec; decodes and prefill chunks of one step
share the call. Shapes:

    q              [B, T, nq, hd]       queries (RoPE applied), any float dtype
    k_new, v_new   [B, T, nkv, hd]      this step's keys / values
    k_cache, v_cache [L, num_pages, page_size, nkv, hd]   all attention layers, token-major (token_major.py;
                                        contract in docs/internals.md)
    layer          int32 scalar         attention layer to use
    q_lens         [B] int32            new tokens per row (0: padding row; nothing written, output 0)
    kv_lens        [B] int32            context length after this step (prefix + q_len)
    page_table     [B, P] int32         page of key position j is page_table[b, j // page_size]

GQA: the ``G = nq / nkv`` query heads of one KV head are stacked into the rows of one matmul
(``[q_block * G, hd] x [hd, keys]``), so a K/V page is read once for all of its query heads. Inside the
kernel the queries are ``[B, nkv, T * G, hd]`` (transposed by XLA outside).

Grid ``(B / rows_per_step, T / q_block)``. T == 1 (a decode step): ``decode_seqs`` sequences per grid step.
T > 1: one sequence per step, ``prefill_q`` query tokens per step. The row axis is "parallel", the query-block
axis "arbitrary" (the K/V write at the first query block must precede the reads of later blocks). Scalar
metadata (layer, lengths, flattened page table, the layer's K/V scales) is scalar-prefetched into SMEM. Block
sizes: ``block_sizes.py``. Page fetches are double-buffered: block kb + 1's pages load while block kb computes.

FP8 pages (kv_quant.py): the new K/V are quantised (``x / scale``, saturated) before the call; reads upcast each
page tile to the query dtype in VMEM (exact) and apply the scales to the float32 scores (K) and the output (V).
An FP8 pool is stored packed, ``[L, N, page_size / r, r * nkv, hd]`` with ``r * nkv`` a multiple of 4
(token_major.py: otherwise XLA's default layout for the pool differs from the kernel's and it copies the pool
around every call). One token of a packed row is a sub-tile slice Mosaic's DMA cannot address, so for FP8 the
new tokens are written by an XLA whole-row scatter before the call (``_scatter_rows``, in place), and a block's
head ``h`` is read as the ``r`` sublane slices ``p * nkv + h`` stacked (keys reordered; ``_key_offsets`` gives
their positions for the masks).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from sglang_tpu_qwen.kernels.ragged_paged_attention.block_sizes import BlockSizes, block_sizes_for
from sglang_tpu_qwen.kernels.ragged_paged_attention.kv_quant import is_fp8, quantize_kv, scale_or_one
from sglang_tpu_qwen.kernels.ragged_paged_attention.token_major import TOKEN_MAJOR, tokens_per_row

# Integer division in the kernel uses lax.div / lax.rem (operands are >= 0): jnp's floor division lowers
# through `sign`, whose Mosaic rule asks the *local* device for its TPU generation, which breaks deviceless AOT.
# Float32 inputs (--dtype float32) multiply in float32: Mosaic's default for a float32 matmul is one bfloat16 pass
# (~1e-2 off the reference on the chip). Mosaic refuses the fp32 contract precision for bfloat16 operands, whose
# default pass is exact anyway (_precision).
_HI = jax.lax.Precision.HIGHEST
_MASK = -1e30  # finite: a fully masked row must not turn into NaN via (-inf) - (-inf)


def _kernel(
    layer_ref, qlen_ref, kvlen_ref, pt_ref, scale_ref,  # scalar prefetch (SMEM)
    q_ref, knew_hbm, vnew_hbm, _kc_in, _vc_in,  # inputs
    o_ref, kc_hbm, vc_hbm,  # outputs (the caches are aliased to their inputs)
    kbuf, vbuf, rsem, wsem, m_ref, l_ref, acc_ref,  # scratch
    *, rows_per_step: int, q_block: int, groups: int, page_size: int, kv_pages: int, pages_per_seq: int,
    sm_scale: float, fp8: bool, per_row: int,
):
    i, j = pl.program_id(0), pl.program_id(1)
    layer = layer_ref[0]
    # FP8 pages: the K scale folds into the score scale, the V scale multiplies the output (module docstring).
    score_scale, out_scale = (sm_scale * scale_ref[0], scale_ref[1]) if fp8 else (sm_scale, None)
    for s in range(rows_per_step):
        _one_sequence(s, i * rows_per_step + s, j, layer, qlen_ref, kvlen_ref, pt_ref, q_ref, knew_hbm, vnew_hbm,
                      o_ref, kc_hbm, vc_hbm, kbuf, vbuf, rsem, wsem, m_ref, l_ref, acc_ref, score_scale, out_scale,
                      q_block=q_block, groups=groups, page_size=page_size, kv_pages=kv_pages,
                      pages_per_seq=pages_per_seq, per_row=per_row)


def _one_sequence(
    s, b, j, layer, qlen_ref, kvlen_ref, pt_ref, q_ref, knew_hbm, vnew_hbm, o_ref, kc_hbm, vc_hbm,
    kbuf, vbuf, rsem, wsem, m_ref, l_ref, acc_ref, score_scale, out_scale,
    *, q_block: int, groups: int, page_size: int, kv_pages: int, pages_per_seq: int, per_row: int,
):
    """Query block j of sequence b (row s of this grid step's block): write its K/V (j == 0), then attend."""
    nkv = q_ref.shape[1]
    rows = q_block * groups
    keys = kv_pages * page_size
    q_len = qlen_ref[b]
    kv_len = kvlen_ref[b]
    prefix = kv_len - q_len

    if per_row == 1:  # packed rows (r > 1) were written by XLA before the call
        @pl.when(j == 0)
        def _write_new_kv():
            def copies(t):
                pos = prefix + t
                page = pt_ref[b * pages_per_seq + jax.lax.div(pos, page_size)]
                off = jax.lax.rem(pos, page_size)
                return (pltpu.make_async_copy(knew_hbm.at[b, t], kc_hbm.at[layer, page, off], wsem.at[0]),
                        pltpu.make_async_copy(vnew_hbm.at[b, t], vc_hbm.at[layer, page, off], wsem.at[1]))

            def start(t, c):
                for cp in copies(t):
                    cp.start()
                return c

            def wait(t, c):
                for cp in copies(t):  # only the shape of the descriptor matters for a wait
                    cp.wait()
                return c

            jax.lax.fori_loop(0, q_len, start, 0)
            jax.lax.fori_loop(0, q_len, wait, 0)

    q_start = j * q_block
    # Absolute position of each query row (row r holds token r // G of the block).
    q_pos = prefix + q_start + jax.lax.div(jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0), groups)
    kv_end = jnp.minimum(kv_len, prefix + q_start + q_block)
    n_blocks = jnp.where(q_start < q_len, jax.lax.div(kv_end + keys - 1, keys), 0)
    m_ref[...] = jnp.full(m_ref.shape, _MASK, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    def fetch(kb, slot):
        """DMA descriptors of KV block kb's pages into buffer slot (0/1)."""
        cps = []
        for p in range(kv_pages):
            col = jnp.minimum(kb * kv_pages + p, pages_per_seq - 1)
            page = pt_ref[b * pages_per_seq + col]
            cps.append(pltpu.make_async_copy(kc_hbm.at[layer, page], kbuf.at[slot, p], rsem.at[slot, 0]))
            cps.append(pltpu.make_async_copy(vc_hbm.at[layer, page], vbuf.at[slot, p], rsem.at[slot, 1]))
        return cps

    @pl.when(n_blocks > 0)
    def _prefetch_first():
        for cp in fetch(0, 0):
            cp.start()

    def kv_block(kb, c):
        slot = jax.lax.rem(kb, 2)

        @pl.when(kb + 1 < n_blocks)
        def _prefetch_next():  # double buffering: the next block's pages load while this one computes
            for cp in fetch(kb + 1, 1 - slot):
                cp.start()

        for cp in fetch(kb, slot):
            cp.wait()
        k_all = kbuf[slot].reshape(keys // per_row, per_row * nkv, -1)
        v_all = vbuf[slot].reshape(keys // per_row, per_row * nkv, -1)
        key_row = kb * keys + _key_offsets((1, keys), 1, keys, per_row)
        key_col = kb * keys + _key_offsets((keys, 1), 0, keys, per_row)
        mask = (key_row < kv_len) & (key_row <= q_pos)  # [rows, keys]
        key_ok = key_col < kv_len  # [keys, 1]
        for h in range(nkv):
            q = q_ref[s, h]  # [rows, hd]
            # Zero keys/values past the context: stale or trash-page contents must not reach a row as NaN. The
            # upcast comes first (exact for FP8 pages): the select then runs on the query dtype's tiles.
            k = jnp.where(key_ok, _head(k_all, h, nkv, per_row).astype(q.dtype), 0)
            v = jnp.where(key_ok, _head(v_all, h, nkv, per_row).astype(q.dtype), 0)
            sc = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=_precision(q.dtype),
                                     preferred_element_type=jnp.float32)
            sc = jnp.where(mask, sc * score_scale, _MASK)
            m_prev = m_ref[h]  # [rows, 128], lanes equal
            m_new = jnp.maximum(m_prev, jnp.max(sc, axis=1, keepdims=True))
            pr = jnp.where(mask, jnp.exp(sc - m_new[:, :1]), 0.0)
            alpha = jnp.exp(m_prev - m_new)
            l_ref[h] = alpha * l_ref[h] + jnp.sum(pr, axis=1, keepdims=True)
            pv = jnp.dot(pr.astype(v.dtype), v, precision=_precision(v.dtype), preferred_element_type=jnp.float32)
            acc_ref[h] = acc_ref[h] * alpha[:, :1] + pv
            m_ref[h] = m_new
        return c

    jax.lax.fori_loop(0, n_blocks, kv_block, 0)
    for h in range(nkv):
        denom = l_ref[h][:, :1]
        out = acc_ref[h] / jnp.where(denom == 0.0, 1.0, denom)
        if out_scale is not None:
            out = out * out_scale
        o_ref[s, h] = out.astype(o_ref.dtype)


def _precision(dtype) -> jax.lax.Precision | None:
    """HIGHEST for float32 operands, Mosaic's default otherwise (module constant _HI)."""
    return _HI if jnp.dtype(dtype) == jnp.float32 else None


def _head(kv_all, h: int, nkv: int, per_row: int):
    """Head h's ``[keys, hd]`` rows of a block read as ``[keys / r, r * nkv, hd]``: the r sublane slices of the
    head stacked (key order: all tokens ``t % r == 0``, then ``1``, ...; softmax does not depend on key order,
    and :func:`_key_offsets` gives each row its position)."""
    if per_row == 1:
        return kv_all[:, h, :]
    return jnp.concatenate([kv_all[:, p * nkv + h, :] for p in range(per_row)], axis=0)


def _key_offsets(shape: tuple[int, int], dim: int, keys: int, per_row: int):
    """Position within the block of each key row as :func:`_head` orders them."""
    i = jax.lax.broadcasted_iota(jnp.int32, shape, dim)
    if per_row == 1:
        return i
    n = keys // per_row
    return jax.lax.rem(i, n) * per_row + jax.lax.div(i, n)


def _scatter_rows(pool, new, layer, q_lens, kv_lens, page_table, page_size: int, per_row: int):
    """Write ``new [B, T, nkv, hd]`` (already in the pool dtype) into a packed pool ``[L, N, page / r, r * nkv,
    hd]`` in place. Whole rows (one (4, 128)-tiled sublane group each) are scattered, so XLA keeps the pool's
    layout: the first new token of each row writes the row, merging the step's other tokens of that row and
    the row's old contents (tokens of the prefix); padded tokens and the row's later tokens write nothing."""
    b, t, nkv, hd = new.shape
    layer = jnp.asarray(layer, jnp.int32)
    tok = jnp.arange(t, dtype=jnp.int32)[None, :]
    prefix = (kv_lens - q_lens).astype(jnp.int32)[:, None]
    pos = prefix + tok  # [B, T]
    col = jnp.clip(pos // page_size, 0, page_table.shape[1] - 1)
    page = jnp.take_along_axis(page_table.astype(jnp.int32), col, axis=1)
    row = (pos % page_size) // per_row
    first = (tok < q_lens[:, None]) & ((pos % per_row == 0) | (tok == 0))
    old = pool[layer, page, row].reshape(b, t, per_row, nkv, hd)  # [B, T, r, nkv, hd]
    # Token of the step at each sublane group p of the row (may be outside [0, q_len): then the old contents).
    src = (pos - pos % per_row)[..., None] + jnp.arange(per_row, dtype=jnp.int32) - prefix[..., None]
    fresh = (src >= 0) & (src < q_lens[:, None, None])
    picked = jnp.take_along_axis(new, jnp.clip(src, 0, t - 1).reshape(b, t * per_row)[..., None, None], axis=1)
    merged = jnp.where(fresh[..., None, None], picked.reshape(b, t, per_row, nkv, hd), old)
    page = jnp.where(first, page, pool.shape[1])  # out of range: dropped
    return pool.at[layer, page, row].set(merged.reshape(b, t, per_row * nkv, hd), mode="drop",
                                         unique_indices=True)


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
    """Write a step's K/V into the paged cache and attend every sequence of the step (see module docstring).

    Args:
        q: ``[B, T, nq, hd]`` queries; ``nq`` a multiple of ``nkv``.
        k_new, v_new: ``[B, T, nkv, hd]`` new keys / values (stored as ``kv_quant.quantize_kv`` gives them: cast to
            the cache dtype, or for FP8 caches divided by the scale and saturated).
        k_cache, v_cache: ``TOKEN_MAJOR.pool_shape(L, num_pages, page_size, nkv, hd, dtype)`` (``[L, num_pages,
            page_size, nkv, hd]``, FP8 packed; token_major.py), donated and updated in place; float32, bfloat16
            or float8_e4m3fn.
        layer: attention-layer index into the caches (int32 scalar, may be traced).
        q_lens: ``[B]`` int32 valid new tokens per row (``<= T``).
        kv_lens: ``[B]`` int32 context length including the new tokens.
        page_table: ``[B, P]`` int32 page ids.
        k_scale, v_scale: this layer's FP8 dequantisation scales (float32 scalars, may be traced; None = 1.0);
            ignored for other cache dtypes.
        sm_scale: softmax scale, default ``hd ** -0.5``.
        block_sizes: tiling; default from ``block_sizes_for(hd, page_size)`` for the current device.
        interpret: run in Pallas TPU interpret mode (``pltpu.InterpretParams()``), for CPU.

    Returns:
        ``(out [B, T, nq, hd] in q.dtype, k_cache, v_cache)``. Rows ``t >= q_lens[b]`` of ``out`` are finite
        but meaningless (0 for rows with ``q_lens[b] == 0``); the K/V of padded tokens is not written.

    Raises:
        ValueError: when ``nq`` is not a multiple of ``nkv``, or the caches are not in the token-major
            ``pool_shape``.
    """
    b, t, nq, hd = q.shape
    nkv = k_new.shape[2]
    page_size = TOKEN_MAJOR.page_size_of(k_cache, nkv)
    per_row = tokens_per_row(k_cache.dtype, nkv)
    if k_cache.shape != TOKEN_MAJOR.pool_shape(k_cache.shape[0], k_cache.shape[1], page_size, nkv, hd, k_cache.dtype):
        raise ValueError(f"cache shape {k_cache.shape} is not the token-major pool_shape for {nkv} KV heads of {hd}")
    if nq % nkv:
        raise ValueError(f"query heads ({nq}) must be a multiple of KV heads ({nkv})")
    groups = nq // nkv
    bs = block_sizes or block_sizes_for(hd, page_size)
    if t == 1:
        q_block, rows_per_step = 1, min(bs.decode_seqs, b)
    else:
        q_block, rows_per_step = min(bs.prefill_q, t), 1
    pad_b, pad_t = (-b) % rows_per_step, (-t) % q_block
    if pad_b or pad_t:
        q = jnp.pad(q, ((0, pad_b), (0, pad_t), (0, 0), (0, 0)))
        k_new = jnp.pad(k_new, ((0, pad_b), (0, pad_t), (0, 0), (0, 0)))
        v_new = jnp.pad(v_new, ((0, pad_b), (0, pad_t), (0, 0), (0, 0)))
        q_lens, kv_lens = jnp.pad(q_lens, (0, pad_b)), jnp.pad(kv_lens, (0, pad_b))
        page_table = jnp.pad(page_table, ((0, pad_b), (0, 0)))
    bp, tp = b + pad_b, t + pad_t
    pages_per_seq = page_table.shape[1]
    qt = q.reshape(bp, tp, nkv, groups, hd).transpose(0, 2, 1, 3, 4).reshape(bp, nkv, tp * groups, hd)
    fp8 = is_fp8(k_cache.dtype)
    if is_fp8(v_cache.dtype) != fp8:
        raise ValueError(f"K and V caches must both be FP8 or neither: {k_cache.dtype}, {v_cache.dtype}")
    k_new, v_new = quantize_kv(k_new, k_cache.dtype, k_scale), quantize_kv(v_new, v_cache.dtype, v_scale)
    if per_row > 1:
        # A token is a sub-tile slice of a packed row ((4, 128) tiles of 1-byte sublanes), which Mosaic's DMA
        # cannot address; XLA's scatter writes it in place (the pool is donated) before the kernel reads.
        k_cache = _scatter_rows(k_cache, k_new, layer, q_lens, kv_lens, page_table, page_size, per_row)
        v_cache = _scatter_rows(v_cache, v_new, layer, q_lens, kv_lens, page_table, page_size, per_row)
    scales = jnp.stack([scale_or_one(k_scale), scale_or_one(v_scale)])
    rows = q_block * groups
    kernel = functools.partial(
        _kernel, rows_per_step=rows_per_step, q_block=q_block, groups=groups, page_size=page_size,
        kv_pages=bs.kv_pages, pages_per_seq=pages_per_seq, sm_scale=sm_scale or hd**-0.5, fp8=fp8,
        per_row=per_row)
    q_spec = pl.BlockSpec((rows_per_step, nkv, rows, hd), lambda i, j, *_: (i, 0, j, 0))
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    out, k_cache, v_cache = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=5,
            grid=(bp // rows_per_step, tp // q_block),
            in_specs=[q_spec, any_spec, any_spec, any_spec, any_spec],
            out_specs=[q_spec, any_spec, any_spec],
            scratch_shapes=[
                pltpu.VMEM((2, bs.kv_pages, *k_cache.shape[2:]), k_cache.dtype),
                pltpu.VMEM((2, bs.kv_pages, *v_cache.shape[2:]), v_cache.dtype),
                pltpu.SemaphoreType.DMA((2, 2)),
                pltpu.SemaphoreType.DMA((2,)),
                pltpu.VMEM((nkv, rows, 128), jnp.float32),
                pltpu.VMEM((nkv, rows, 128), jnp.float32),
                pltpu.VMEM((nkv, rows, hd), jnp.float32),
            ],
        ),
        out_shape=[jax.ShapeDtypeStruct(qt.shape, q.dtype),
                   jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
                   jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype)],
        # Operand indices count the 5 scalar-prefetch operands: k_cache is operand 8, v_cache operand 9.
        input_output_aliases={8: 1, 9: 2},
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary"), vmem_limit_bytes=bs.vmem_limit_bytes),
        interpret=pltpu.InterpretParams() if interpret else False,
        # XLA cannot see in: the traffic is q, the new K/V and the output, plus each row's pages of this
        # layer (all P columns: an upper bound, exact for full-context rows), not the whole caches.
        cost_estimate=pl.CostEstimate(
            flops=int(4 * bp * tp * nq * hd * pages_per_seq * page_size), transcendentals=int(
                bp * tp * nq * pages_per_seq * page_size),
            bytes_accessed=int(2 * qt.size * q.dtype.itemsize + 2 * k_new.size * k_new.dtype.itemsize
                               + 2 * bp * pages_per_seq * page_size * nkv * hd * k_cache.dtype.itemsize)),
    )(
        jnp.reshape(jnp.asarray(layer, jnp.int32), (1,)), q_lens.astype(jnp.int32), kv_lens.astype(jnp.int32),
        page_table.astype(jnp.int32).reshape(-1), scales, qt, k_new, v_new, k_cache, v_cache,
    )
    out = out.reshape(bp, nkv, tp, groups, hd).transpose(0, 2, 1, 3, 4).reshape(bp, tp, nq, hd)
    return out[:b, :t], k_cache, v_cache
