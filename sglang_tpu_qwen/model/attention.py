"""Gated GQA attention over a paged KV cache (pure-jnp reference).

Math follows HF ``Qwen3_5MoeAttention``: ``q_proj`` emits per head ``[query, gate]``; per-head q/k
RMSNorm (``1 + w``); partial RoPE; softmax attention with scale ``hd^-0.5``; output times
``sigmoid(gate)`` before ``o_proj``. Paging follows vLLM's PagedAttention (Kwon et al., SOSP 2023).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from sglang_tpu_qwen.kernels.attention_backend import AttentionBackend
from sglang_tpu_qwen.kernels.moe_backend import MoeBackend
from sglang_tpu_qwen.kernels.ragged_paged_attention.reference import page_slots, paged_attention, write_kv
from sglang_tpu_qwen.model.config import Qwen35MoeConfig
from sglang_tpu_qwen.model.forward_batch import ForwardBatch
from sglang_tpu_qwen.model.norms import rms_norm
from sglang_tpu_qwen.model.rope import apply_rope


def attention_layer(
    p: dict[str, Any],
    x: jax.Array,
    batch: ForwardBatch,
    rope: tuple[jax.Array, jax.Array],
    k_cache: jax.Array,
    v_cache: jax.Array,
    layer: jax.Array | int,
    config: Qwen35MoeConfig,
    backend: AttentionBackend | None = None,
    matmul: MoeBackend | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One gated attention block (token mixer only; norms and residual are the caller's).

    Args:
        p: ``{"q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"}`` (see docs/internals.md); the
            projections dense or :class:`quant.fp8.Fp8Weight`; optionally the checkpoint's ``"k_scale"``,
            ``"v_scale"`` (float32 scalars), which an FP8 cache stores and reads its pages with (1.0 without;
            kernels/ragged_paged_attention/kv_quant.py) and any other cache ignores.
        x: ``[B, T, H]`` normalised hidden states.
        batch: the step (model/forward_batch.py): its page table, positions, valid tokens (padded tokens'
            K/V go to trash page 0) and KV lengths.
        rope: ``(cos, sin)``, each ``[B, T, rotary_dim]`` float32, for ``batch.positions``.
        k_cache, v_cache: logically ``[L_attn, num_pages, page_size, nkv, hd]``, stored as ``backend.layout``
            says (kernels/ragged_paged_attention/layout.py), the compute dtype or float8_e4m3fn.
        layer: index of this layer among the attention layers.
        config: model config.
        backend: the attention backend (kernels/attention_backend.py): its kernel, with the signature of
            ``kernels.ragged_paged_attention`` (``(q, k, v, k_cache, v_cache, layer, q_lens, kv_lens,
            page_table, *, k_scale, v_scale) -> (attn, k_cache, v_cache)``), replaces write_kv +
            paged_attention; without one (the reference backend, or None) the reference runs on its layout
            (None: the default, token-major).
        matmul: runs the q/k/v/o projections (``MoeBackend.linear``: the Pallas block-FP8 kernel for FP8
            weights under ``pallas``, kernels/moe_backend.py); None: the reference.

    Returns:
        ``(out [B, T, H], k_cache, v_cache)`` with the new K/V written.
    """
    b, t, _ = x.shape
    nq, nkv, hd = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    eps = config.rms_norm_eps
    linear = (matmul or MoeBackend()).linear
    qg = linear(x, p["q_proj"]).reshape(b, t, nq, 2 * hd)
    q, gate = qg[..., :hd], qg[..., hd:].reshape(b, t, nq * hd)
    q = rms_norm(q, p["q_norm"], eps)
    k = rms_norm(linear(x, p["k_proj"]).reshape(b, t, nkv, hd), p["k_norm"], eps)
    v = linear(x, p["v_proj"]).reshape(b, t, nkv, hd)
    q = apply_rope(q, *rope)
    k = apply_rope(k, *rope)

    valid, kv_lens, page_table = batch.valid, batch.kv_lens, batch.page_table
    k_scale, v_scale = p.get("k_scale"), p.get("v_scale")
    backend = backend or AttentionBackend()
    if (core := backend.kernel) is not None:
        q_lens = jnp.sum(valid, axis=1, dtype=jnp.int32)
        attn, k_cache, v_cache = core(q, k, v, k_cache, v_cache, layer, q_lens, kv_lens, page_table,
                                      k_scale=k_scale, v_scale=v_scale)
    else:
        positions, layout = batch.positions, backend.layout
        pages, offsets = page_slots(positions, valid, page_table, layout.page_size_of(k_cache, nkv))
        k_cache = write_kv(k_cache, layer, k, pages, offsets, k_scale, layout=layout)
        v_cache = write_kv(v_cache, layer, v, pages, offsets, v_scale, layout=layout)
        attn = paged_attention(q, k_cache, v_cache, layer, page_table, positions, kv_lens, k_scale, v_scale,
                               nkv=nkv, layout=layout)
    out = attn.reshape(b, t, nq * hd) * jax.nn.sigmoid(gate)
    return linear(out, p["o_proj"]), k_cache, v_cache
