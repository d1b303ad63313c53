"""Gated GQA attention over a paged KV cache (pure-jnp reference).

Math follows HF ``Qwen3_5MoeAttention``: ``q_proj`` emits per head ``[query, gate]``; per-head q/k
RMSNorm (``1 + w``); partial RoPE; softmax attention with scale ``hd^-0.5``; output times
``sigmoid(gate)`` before ``o_proj``. Paging follows vLLM's PagedAttention (Kwon et al., SOSP 2023).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from sglang_tpu_qwen.model.config import Qwen35MoeConfig
from sglang_tpu_qwen.model.norms import rms_norm
from sglang_tpu_qwen.model.rope import apply_rope
from sglang_tpu_qwen.parallel.fp8 import linear


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


def write_kv(cache: jax.Array, layer: int, new: jax.Array, pages: jax.Array, offsets: jax.Array) -> jax.Array:
    """Scatter new keys (or values) of one layer into the paged cache.

    Args:
        cache: ``[L, num_pages, page_size, nkv, hd]`` all attention layers.
        layer: attention-layer index into ``cache``.
        new: ``[B, T, nkv, hd]``.
        pages, offsets: ``[B, T]`` from :func:`page_slots`.

    Returns:
        The updated cache (same shape and dtype).
    """
    return cache.at[layer, pages, offsets].set(new.astype(cache.dtype))


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
) -> jax.Array:
    """Causal GQA attention of new queries over the pages of the whole context.

    The page table may be much wider than the context (the server compiles one fixed width per request,
    engine/buckets.py): keys are visited in blocks of ``_PAGES_PER_BLOCK`` pages by a loop whose trip
    count is ``ceil(max(kv_lens) / block)``, with an online softmax (Milakov & Gimelshein 2018; the
    FlashAttention recurrence), so the cost follows the longest context in the batch, not the width.

    Args:
        q: ``[B, T, nq, hd]`` queries (RoPE applied).
        k_cache, v_cache: ``[L, num_pages, page_size, nkv, hd]``.
        layer: attention-layer index.
        page_table: ``[B, P]`` int32; key position ``j`` of row ``b`` lives in page ``page_table[b, j // ps]``.
        q_positions: ``[B, T]`` int32 absolute query positions.
        kv_lens: ``[B]`` int32 context length (keys at positions ``>= kv_len`` are masked).

    Returns:
        ``[B, T, nq, hd]`` in ``q.dtype``. Rows with no visible key (padding rows) give zeros.
    """
    b, t, nq, hd = q.shape
    _, _, ps, nkv, _ = k_cache.shape
    bp = min(_PAGES_PER_BLOCK, page_table.shape[1])
    pad = (-page_table.shape[1]) % bp
    if pad:
        page_table = jnp.pad(page_table, ((0, 0), (0, pad)))
    blk = bp * ps
    num_blocks = jnp.minimum((jnp.max(kv_lens) + blk - 1) // blk, page_table.shape[1] // bp)
    qg = q.reshape(b, t, nkv, nq // nkv, hd)
    g = nq // nkv

    def body(i: jax.Array, carry: tuple[jax.Array, jax.Array, jax.Array]) -> tuple[jax.Array, ...]:
        m, denom, acc = carry
        cols = jax.lax.dynamic_slice_in_dim(page_table, i * bp, bp, axis=1)
        k = k_cache[layer, cols].reshape(b, blk, nkv, hd)
        v = v_cache[layer, cols].reshape(b, blk, nkv, hd)
        key_pos = i * blk + jnp.arange(blk, dtype=jnp.int32)
        key_ok = key_pos[None, :] < kv_lens[:, None]  # [B, blk]
        # Zero unused keys/values so stale or trash contents (page 0) can never reach real rows as NaN * 0.
        k = jnp.where(key_ok[:, :, None, None], k, 0).astype(q.dtype)
        v = jnp.where(key_ok[:, :, None, None], v, 0).astype(q.dtype)
        mask = (key_ok[:, None, :] & (key_pos[None, None, :] <= q_positions[:, :, None]))[:, None, None]
        s = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * (hd**-0.5)
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
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, nq, hd).astype(q.dtype)


def attention_layer(
    p: dict[str, Any],
    x: jax.Array,
    cos: jax.Array,
    sin: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    layer: int,
    page_table: jax.Array,
    positions: jax.Array,
    valid: jax.Array,
    kv_lens: jax.Array,
    config: Qwen35MoeConfig,
    core: Callable | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One gated attention block (token mixer only; norms and residual are the caller's).

    Args:
        p: ``{"q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"}`` (see docs/internals.md); the
            projections dense or :class:`parallel.fp8.Fp8Weight`.
        x: ``[B, T, H]`` normalised hidden states.
        cos, sin: ``[B, T, rotary_dim]`` float32 RoPE tables for ``positions``.
        k_cache, v_cache: ``[L_attn, num_pages, page_size, nkv, hd]``.
        layer: index of this layer among the attention layers.
        page_table: ``[B, P]`` int32.
        positions: ``[B, T]`` int32 absolute positions of the new tokens.
        valid: ``[B, T]`` bool, False for padded tokens (their K/V go to trash page 0).
        kv_lens: ``[B]`` int32, prefix_len + new_len.
        config: model config.
        core: optional replacement for write_kv + paged_attention with the signature of
            ``kernels.ragged_paged_attention`` (``(q, k, v, k_cache, v_cache, layer, q_lens, kv_lens,
            page_table) -> (attn, k_cache, v_cache)``); None runs this module's reference.

    Returns:
        ``(out [B, T, H], k_cache, v_cache)`` with the new K/V written.
    """
    b, t, _ = x.shape
    nq, nkv, hd = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    eps = config.rms_norm_eps
    qg = linear(x, p["q_proj"]).reshape(b, t, nq, 2 * hd)
    q, gate = qg[..., :hd], qg[..., hd:].reshape(b, t, nq * hd)
    q = rms_norm(q, p["q_norm"], eps)
    k = rms_norm(linear(x, p["k_proj"]).reshape(b, t, nkv, hd), p["k_norm"], eps)
    v = linear(x, p["v_proj"]).reshape(b, t, nkv, hd)
    q = apply_rope(q, cos, sin)
    k = apply_rope(k, cos, sin)

    if core is not None:
        q_lens = jnp.sum(valid, axis=1, dtype=jnp.int32)
        attn, k_cache, v_cache = core(q, k, v, k_cache, v_cache, layer, q_lens, kv_lens, page_table)
    else:
        pages, offsets = page_slots(positions, valid, page_table, k_cache.shape[2])
        k_cache = write_kv(k_cache, layer, k, pages, offsets)
        v_cache = write_kv(v_cache, layer, v, pages, offsets)
        attn = paged_attention(q, k_cache, v_cache, layer, page_table, positions, kv_lens)
    out = attn.reshape(b, t, nq * hd) * jax.nn.sigmoid(gate)
    return linear(out, p["o_proj"]), k_cache, v_cache
