"""Pure-jnp reference of the ragged paged attention kernel: the model's own paged attention.

Same signature and layouts as :func:`kernel.ragged_paged_attention`; the math is
``page_slots`` / ``write_kv`` / ``paged_attention`` below (Kwon et al., SOSP 2023), which the model imports
and runs off TPU. One difference by design: the reference writes padded tokens to trash page 0, the
kernel skips them; page 0 is never read by a real row. FP8 caches (kv_quant.py): writes store
``x / scale`` saturated to float8_e4m3fn, reads dequantise ``q * scale`` with the scale applied to the
float32 scores (K) and to the output (V), the same product as scaling every element, one multiply per row.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from sglang_tpu_qwen.kernels.ragged_paged_attention.kv_quant import is_fp8, quantize_kv, scale_or_one
from sglang_tpu_qwen.kernels.ragged_paged_attention.layout import KVPoolLayout
from sglang_tpu_qwen.kernels.ragged_paged_attention.token_major import TOKEN_MAJOR


def page_slots(
    positions: jax.Array, valid: jax.Array, page_table: jax.Array, page_size: int
) -> tuple[jax.Array, jax.Array]:
    """Map token positions to (page id, offset in page); invalid tokens go to trash page 0.

    Args:
        positions: ``[B, T]`` int32 absolute positions.
        valid: ``[B, T]`` bool.
        page_table: ``[B, P]`` int32 page ids of each sequence.
        page_size: tokens per page.

    Returns:
        ``(pages [B, T], offsets [B, T])`` int32.
    """
    num_cols = page_table.shape[1]
    col = jnp.clip(positions // page_size, 0, num_cols - 1)
    pages = jnp.take_along_axis(page_table, col, axis=1)
    pages = jnp.where(valid, pages, 0)
    return pages, positions % page_size


def write_kv(cache: jax.Array, layer: int, new: jax.Array, pages: jax.Array, offsets: jax.Array,
             scale: Any = None, *, layout: KVPoolLayout = TOKEN_MAJOR) -> jax.Array:
    """Scatter new keys (or values) of one layer into the paged cache.

    Args:
        cache: all attention layers, as ``layout.pool_shape`` stores them (layout.py).
        layer: attention-layer index into ``cache``.
        new: ``[B, T, nkv, hd]``.
        pages, offsets: ``[B, T]`` from :func:`page_slots`.
        scale: the layer's K (or V) scale, float32 scalar or None (1.0); used only by an FP8 cache.
        layout: the pool's layout.

    Returns:
        The updated cache (same shape and dtype), ``new`` stored as ``kv_quant.quantize_kv`` gives it.
    """
    return layout.write_tokens(cache, layer, quantize_kv(new, cache.dtype, scale), pages, offsets)


_PAGES_PER_BLOCK = 8  # key block of the reference loop: 8 pages (128 keys at page size 16)
_MASKED = -1e30  # finite: a fully masked row (padding) stays NaN-free through the online softmax


def paged_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    layer: int,
    page_table: jax.Array,
    q_positions: jax.Array,
    kv_lens: jax.Array,
    k_scale: Any = None,
    v_scale: Any = None,
    *,
    nkv: int,
    layout: KVPoolLayout = TOKEN_MAJOR,
) -> jax.Array:
    """Causal GQA attention of new queries over the pages of the whole context.

    The page table may be much wider than the context (the server compiles one fixed width per request,
    engine/runner/buckets.py): keys are visited in blocks of ``_PAGES_PER_BLOCK`` pages by a loop whose trip
    count is ``ceil(max(kv_lens) / block)``, with an online softmax (Milakov & Gimelshein 2018; the
    FlashAttention recurrence), so the cost follows the longest context in the batch, not the width.

    Args:
        q: ``[B, T, nq, hd]`` queries (RoPE applied).
        k_cache, v_cache: all attention layers, as ``layout.pool_shape`` stores them (logically ``[L, num_pages,
            page_size, nkv, hd]``, layout.py).
        layer: attention-layer index.
        page_table: ``[B, P]`` int32; key position ``j`` of row ``b`` lives in page ``page_table[b, j // ps]``.
        q_positions: ``[B, T]`` int32 absolute query positions.
        kv_lens: ``[B]`` int32 context length (keys at positions ``>= kv_len`` are masked).
        k_scale, v_scale: the layer's dequantisation scales (float32 scalars, None = 1.0), read only when the
            caches are FP8 (kv_quant.py); the pages are upcast to ``q.dtype`` (exact: every e4m3 value is a
            bfloat16) and the scales multiply the float32 scores and the output.
        nkv: KV heads (a packed pool's stored shape does not tell them).
        layout: the pools' layout; pages are read through ``layout.page_reader``.

    Returns:
        ``[B, T, nq, hd]`` in ``q.dtype``. Rows with no visible key (padding rows) give zeros.
    """
    b, t, nq, hd = q.shape
    ps = layout.page_size_of(k_cache, nkv)
    read_k, read_v = layout.page_reader(k_cache, nkv), layout.page_reader(v_cache, nkv)
    bp = min(_PAGES_PER_BLOCK, page_table.shape[1])
    pad = (-page_table.shape[1]) % bp
    if pad:
        page_table = jnp.pad(page_table, ((0, 0), (0, pad)))
    blk = bp * ps
    num_blocks = jnp.minimum((jnp.max(kv_lens) + blk - 1) // blk, page_table.shape[1] // bp)
    qg = q.reshape(b, t, nkv, nq // nkv, hd)
    g = nq // nkv
    fp8 = is_fp8(k_cache.dtype)
    score_scale = hd**-0.5 * scale_or_one(k_scale) if fp8 else hd**-0.5

    def body(i: jax.Array, carry: tuple[jax.Array, jax.Array, jax.Array]) -> tuple[jax.Array, ...]:
        m, denom, acc = carry
        cols = jax.lax.dynamic_slice_in_dim(page_table, i * bp, bp, axis=1)
        k = read_k(layer, cols).reshape(b, blk, nkv, hd)
        v = read_v(layer, cols).reshape(b, blk, nkv, hd)
        key_pos = i * blk + jnp.arange(blk, dtype=jnp.int32)
        key_ok = key_pos[None, :] < kv_lens[:, None]  # [B, blk]
        # Zero unused keys/values so stale or trash contents (page 0) can never reach real rows as NaN * 0.
        k = jnp.where(key_ok[:, :, None, None], k, 0).astype(q.dtype)
        v = jnp.where(key_ok[:, :, None, None], v, 0).astype(q.dtype)
        mask = (key_ok[:, None, :] & (key_pos[None, None, :] <= q_positions[:, :, None]))[:, None, None]
        s = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * score_scale
        s = jnp.where(mask, s, _MASKED)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
        corr = jnp.exp(m - m_new)
        pv = jnp.einsum("bkgts,bskd->bkgtd", p.astype(q.dtype), v, preferred_element_type=jnp.float32)
        return m_new, denom * corr + jnp.sum(p, axis=-1), acc * corr[..., None] + pv

    init = (jnp.full((b, nkv, g, t), _MASKED, jnp.float32), jnp.zeros((b, nkv, g, t), jnp.float32),
            jnp.zeros((b, nkv, g, t, hd), jnp.float32))
    _, denom, acc = jax.lax.fori_loop(0, num_blocks, body, init)
    out = acc / jnp.maximum(denom, 1e-30)[..., None]  # [B, nkv, g, T, hd]
    if fp8:
        out = out * scale_or_one(v_scale)
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, nq, hd).astype(q.dtype)


def ragged_paged_attention_reference(
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
    k_scale: Any = None,
    v_scale: Any = None,
    layout: KVPoolLayout = TOKEN_MAJOR,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Write new K/V, then causal GQA attention over the pages (shapes as the kernel).

    Args:
        q: ``[B, T, nq, hd]``; k_new, v_new: ``[B, T, nkv, hd]``.
        k_cache, v_cache: as ``layout.pool_shape`` stores them.
        layer: attention-layer index.
        q_lens, kv_lens: ``[B]`` int32 new tokens and context length (prefix + new).
        page_table: ``[B, P]`` int32.
        k_scale, v_scale: FP8 caches' per-layer scales (float32 scalars, None = 1.0; kv_quant.py).
        layout: the pools' layout (layout.py; the kernel reads the token-major one).

    Returns:
        ``(out [B, T, nq, hd] in q.dtype, k_cache, v_cache)``.
    """
    t = q.shape[1]
    ar = jnp.arange(t, dtype=jnp.int32)
    positions = (kv_lens - q_lens)[:, None] + ar[None, :]
    valid = ar[None, :] < q_lens[:, None]
    nkv = k_new.shape[2]
    pages, offsets = page_slots(positions, valid, page_table, layout.page_size_of(k_cache, nkv))
    k_cache = write_kv(k_cache, layer, k_new, pages, offsets, k_scale, layout=layout)
    v_cache = write_kv(v_cache, layer, v_new, pages, offsets, v_scale, layout=layout)
    out = paged_attention(q, k_cache, v_cache, layer, page_table, positions, kv_lens, k_scale, v_scale, nkv=nkv,
                          layout=layout)
    return out, k_cache, v_cache
