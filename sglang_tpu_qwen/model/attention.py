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

    Args:
        q: ``[B, T, nq, hd]`` queries (RoPE applied).
        k_cache, v_cache: ``[L, num_pages, page_size, nkv, hd]``.
        layer: attention-layer index.
        page_table: ``[B, P]`` int32; key position ``j`` of row ``b`` lives in page ``page_table[b, j // ps]``.
        q_positions: ``[B, T]`` int32 absolute query positions.
        kv_lens: ``[B]`` int32 context length (keys at positions ``>= kv_len`` are masked).

    Returns:
        ``[B, T, nq, hd]`` in ``q.dtype``. Rows with no visible key (padding rows) give finite values.
    """
    b, t, nq, hd = q.shape
    _, _, ps, nkv, _ = k_cache.shape
    s = page_table.shape[1] * ps
    k = k_cache[layer, page_table].reshape(b, s, nkv, hd)
    v = v_cache[layer, page_table].reshape(b, s, nkv, hd)
    key_pos = jnp.arange(s, dtype=jnp.int32)
    key_ok = key_pos[None, :] < kv_lens[:, None]  # [B, S]
    # Zero unused keys/values so stale or trash contents (page 0) can never reach real rows as NaN * 0.
    k = jnp.where(key_ok[:, :, None, None], k, 0).astype(q.dtype)
    v = jnp.where(key_ok[:, :, None, None], v, 0).astype(q.dtype)
    mask = key_ok[:, None, :] & (key_pos[None, None, :] <= q_positions[:, :, None])  # [B, T, S]

    qg = q.reshape(b, t, nkv, nq // nkv, hd)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * (hd**-0.5)
    # A finite fill keeps fully masked rows (padding) from producing NaN.
    scores = jnp.where(mask[:, None, None, :, :], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v, preferred_element_type=jnp.float32)
    return out.reshape(b, t, nq, hd).astype(q.dtype)


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
