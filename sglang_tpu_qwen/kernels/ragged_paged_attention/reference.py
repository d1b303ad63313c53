"""Pure-jnp reference of the ragged paged attention kernel: the model's own paged attention.

Same signature and layouts as :func:`kernel.ragged_paged_attention`; the math is
``model.attention.page_slots`` / ``write_kv`` / ``paged_attention`` (Kwon et al., SOSP 2023), which is what the
model runs off TPU. One difference by design: the reference writes padded tokens to trash page 0, the
kernel skips them; page 0 is never read by a real row.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sglang_tpu_qwen.model.attention import page_slots, paged_attention, write_kv


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
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Write new K/V, then causal GQA attention over the pages (shapes as the kernel).

    Args:
        q: ``[B, T, nq, hd]``; k_new, v_new: ``[B, T, nkv, hd]``.
        k_cache, v_cache: ``[L, num_pages, page_size, nkv, hd]``.
        layer: attention-layer index.
        q_lens, kv_lens: ``[B]`` int32 new tokens and context length (prefix + new).
        page_table: ``[B, P]`` int32.

    Returns:
        ``(out [B, T, nq, hd] in q.dtype, k_cache, v_cache)``.
    """
    t = q.shape[1]
    ar = jnp.arange(t, dtype=jnp.int32)
    positions = (kv_lens - q_lens)[:, None] + ar[None, :]
    valid = ar[None, :] < q_lens[:, None]
    pages, offsets = page_slots(positions, valid, page_table, k_cache.shape[2])
    k_cache = write_kv(k_cache, layer, k_new, pages, offsets)
    v_cache = write_kv(v_cache, layer, v_new, pages, offsets)
    out = paged_attention(q, k_cache, v_cache, layer, page_table, positions, kv_lens)
    return out, k_cache, v_cache
