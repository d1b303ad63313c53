"""Gated DeltaNet layer (HF ``Qwen3_5MoeGatedDeltaNet``): input projections, the token mixer, the gated
output norm and ``out_proj``, over the model's state pools.

The mixer's math (causal conv1d + gated delta rule, Yang et al. ICLR 2025 / NeurIPS 2024) lives in
``kernels/gdn/delta_rule.py``, below the model, where the fused kernel's reference shares it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from sglang_tpu_qwen.kernels.gdn.conv_pool import gather_windows, scatter_windows
from sglang_tpu_qwen.kernels.gdn.delta_rule import gated_rms_norm, gdn_mix
from sglang_tpu_qwen.kernels.moe_backend import MoeBackend
from sglang_tpu_qwen.model.config import Qwen35MoeConfig
from sglang_tpu_qwen.model.forward_batch import ForwardBatch


def gdn_projections(
    p: dict[str, Any], x: jax.Array, valid: jax.Array, config: Qwen35MoeConfig, matmul: MoeBackend | None = None
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Input projections of a Gated DeltaNet block, with padded tokens masked.

    Args:
        p: GDN parameters (docs/internals.md); projections dense or :class:`quant.fp8.Fp8Weight`.
        x: ``[B, T, H]`` normalised hidden states.
        valid: ``[B, T]`` bool.
        config: model config.
        matmul: runs ``in_proj_qkv`` / ``in_proj_z`` (``MoeBackend.linear``, kernels/moe_backend.py); None: the
            reference.

    Returns:
        ``(mixed [B, T, conv_dim] in x.dtype (pre-conv q|k|v channels; 0 at padded tokens), z [B, T, Hv, dv],
        g [B, T, Hv] float32 log-decay, beta [B, T, Hv] float32)``; ``g = beta = 0`` at padded tokens.
    """
    bsz, t, _ = x.shape
    hv, dv = config.linear_num_value_heads, config.linear_value_head_dim
    x = jnp.where(valid[..., None], x, 0)
    linear = (matmul or MoeBackend()).linear
    mixed = linear(x, p["in_proj_qkv"])
    z = linear(x, p["in_proj_z"]).reshape(bsz, t, hv, dv)
    beta = jax.nn.sigmoid((x @ p["in_proj_b"]).astype(jnp.float32))
    g = -jnp.exp(p["A_log"].astype(jnp.float32)) * jax.nn.softplus(
        (x @ p["in_proj_a"]).astype(jnp.float32) + p["dt_bias"].astype(jnp.float32)
    )
    g = jnp.where(valid[..., None], g, 0.0)
    beta = jnp.where(valid[..., None], beta, 0.0)
    return mixed, z, g, beta


def gdn_output(p: dict[str, Any], o: jax.Array, z: jax.Array, dtype: Any, config: Qwen35MoeConfig,
               matmul: MoeBackend | None = None) -> jax.Array:
    """Gated RMSNorm per head and ``out_proj`` (through ``matmul.linear``; None: the reference):
    ``o [B, T, Hv, dv]`` (any float), ``z`` -> ``[B, T, H]`` dtype."""
    bsz, t, hv, dv = o.shape
    o = gated_rms_norm(o.astype(dtype), z, p["norm"], config.rms_norm_eps)
    return (matmul or MoeBackend()).linear(o.reshape(bsz, t, hv * dv), p["out_proj"])


def gdn_layer(
    p: dict[str, Any],
    x: jax.Array,
    conv_state: jax.Array,
    rec_state: jax.Array,
    valid: jax.Array,
    new_lens: jax.Array,
    config: Qwen35MoeConfig,
    recurrent: bool = False,
    matmul: MoeBackend | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One Gated DeltaNet block (token mixer only; norms and residual are the caller's).

    Args:
        p: ``{"in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "conv1d", "dt_bias", "A_log",
            "norm", "out_proj"}`` (see docs/internals.md).
        x: ``[B, T, H]`` normalised hidden states; tokens are left-aligned.
        conv_state: ``[B, conv_dim, K-1]`` state before this step (zeros at sequence start).
        rec_state: ``[B, Hv, dk, dv]`` recurrent state before this step.
        valid: ``[B, T]`` bool, ``t < new_lens[b]``.
        new_lens: ``[B]`` int32.
        config: model config.
        recurrent: as :func:`gdn_mix`.
        matmul: runs the projections (``MoeBackend.linear``, kernels/moe_backend.py); None: the reference.

    Returns:
        ``(out [B, T, H] in x.dtype, conv_state, rec_state)``; padded tokens leave both states untouched.
    """
    mixed, z, g, beta = gdn_projections(p, x, valid, config, matmul)
    o, conv_state, rec_state = gdn_mix(mixed, p["conv1d"], g, beta, conv_state, rec_state, valid, new_lens, config,
                                       recurrent)
    return gdn_output(p, o, z, x.dtype, config, matmul), conv_state, rec_state


def gdn_layer_pooled(
    p: dict[str, Any],
    x: jax.Array,
    batch: ForwardBatch,
    conv_pool: jax.Array,
    rec_pool: jax.Array,
    layer: jax.Array | int,
    config: Qwen35MoeConfig,
    pooled_mix: Callable,
    matmul: MoeBackend | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """:func:`gdn_layer` with the conv1d + delta rule done by ``pooled_mix`` directly on the state pools.

    Args:
        p, x, config: as :func:`gdn_layer`.
        batch: the step (model/forward_batch.py): each row's slot id, valid tokens, new-token count, and
            whether its state starts at zero (``fresh``).
        conv_pool: ``[L_gdn, S * (K-1), conv_dim / 128, 128]`` (kernels/gdn/conv_pool.py); rec_pool:
            ``[L_gdn, S, Hv, dk, dv]`` (all GDN layers).
        layer: GDN-layer index.
        pooled_mix: ``kernels.gdn.kernel.fused_gdn`` (or its reference) with ``interpret`` bound.
        matmul: as :func:`gdn_layer`.

    Returns:
        ``(out [B, T, H] in x.dtype, conv_pool, rec_pool)``.
    """
    out, conv_pool, rec_pool, _ = _pooled(p, x, batch, conv_pool, rec_pool, layer, config, pooled_mix, matmul)
    return out, conv_pool, rec_pool


def gdn_layer_verify_pooled(
    p: dict[str, Any],
    x: jax.Array,
    batch: ForwardBatch,
    conv_pool: jax.Array,
    rec_pool: jax.Array,
    layer: jax.Array | int,
    config: Qwen35MoeConfig,
    pooled_mix: Callable,
    matmul: MoeBackend | None = None,
) -> tuple[jax.Array, tuple[jax.Array, jax.Array, jax.Array]]:
    """:func:`gdn_layer_verify` through the fused kernel: ``pooled_mix`` (``fused_gdn``) with ``commit=False``
    reads each row's state from the pools once and writes nothing (the verify step's k + 1 tokens run its
    recurrent form, each token a decode step's arithmetic).

    Args: as :func:`gdn_layer_pooled`.

    Returns:
        ``(out [B, T, H] in x.dtype, (mixed [B, T, conv_dim], g [B, T, Hv] float32, beta [B, T, Hv] float32))``
        as :func:`gdn_layer_verify`; the pools are unchanged.
    """
    out, _, _, inputs = _pooled(p, x, batch, conv_pool, rec_pool, layer, config, pooled_mix, matmul, commit=False)
    return out, inputs


def _pooled(p: dict[str, Any], x: jax.Array, batch: ForwardBatch, conv_pool: jax.Array, rec_pool: jax.Array,
            layer: jax.Array | int, config: Qwen35MoeConfig, pooled_mix: Callable, matmul: MoeBackend | None,
            commit: bool = True) -> tuple[jax.Array, jax.Array, jax.Array, tuple[jax.Array, jax.Array, jax.Array]]:
    """:func:`gdn_layer_pooled`'s body, also returning the kernel's inputs ``(mixed, g, beta)``; ``commit``: as
    ``fused_gdn``'s."""
    bsz, t, _ = x.shape
    mixed, z, g, beta = gdn_projections(p, x, batch.valid, config, matmul)
    # The gated output norm runs inside pooled_mix (its epilogue), as gdn_output would run it.
    o, conv_pool, rec_pool = pooled_mix(
        mixed, p["conv1d"], g, beta, conv_pool, rec_pool, layer, batch.slot_ids, batch.extend_lens, batch.fresh,
        num_k_heads=config.linear_num_key_heads, head_k_dim=config.linear_key_head_dim,
        head_v_dim=config.linear_value_head_dim, gate=z.reshape(bsz, t, -1).astype(x.dtype), norm_weight=p["norm"],
        norm_eps=config.rms_norm_eps, commit=commit)
    out = (matmul or MoeBackend()).linear(o.reshape(bsz, t, -1), p["out_proj"])
    return out, conv_pool, rec_pool, (mixed, g, beta)


def gdn_layer_on_pools(
    p: dict[str, Any],
    x: jax.Array,
    batch: ForwardBatch,
    conv: jax.Array,
    rec: jax.Array,
    layer: jax.Array | int,
    config: Qwen35MoeConfig,
    recurrent: bool = False,
    matmul: MoeBackend | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """:func:`gdn_layer` reading and writing each row's state in the slot pools (jnp reference path).

    Args:
        conv: ``[n_gdn_layers, num_slots * (K-1), conv_dim / 128, 128]`` (kernels/gdn/conv_pool.py); rec:
            ``[n_gdn_layers, num_slots, Hv, dk, dv]``.
        layer: index of this layer among the GDN layers.
        batch: the step: each row's slot id, valid tokens and new-token count; ``batch.fresh`` rows start a
            sequence, so their slot is read as zeros (whatever it holds).
        Others as in :func:`gdn_layer`.

    Returns:
        ``(out [B, T, H], conv, rec)`` with the rows' new states written to their slots.
    """
    conv_s, rec_s = slot_states(batch, conv, rec, layer, config)
    out, conv_s, rec_s = gdn_layer(p, x, conv_s, rec_s, batch.valid, batch.extend_lens, config, recurrent, matmul)
    return out, *write_slot_states(batch, conv, rec, layer, conv_s, rec_s)


def slot_states(batch: ForwardBatch, conv: jax.Array, rec: jax.Array, layer: jax.Array | int,
                config: Qwen35MoeConfig) -> tuple[jax.Array, jax.Array]:
    """Each row's GDN state in layer ``layer`` of the pools: ``(conv [B, conv_dim, K-1], rec [B, Hv, dk, dv])`` in
    the pools' dtype, zeros for a row whose sequence starts in this step (``batch.fresh``)."""
    f = batch.fresh[:, None, None]
    taps = config.linear_conv_kernel_dim - 1
    conv_s = jnp.where(f, 0, jnp.swapaxes(gather_windows(conv, layer, batch.slot_ids, taps), 1, 2))
    return conv_s, jnp.where(f[..., None], 0, rec[layer, batch.slot_ids])


def write_slot_states(batch: ForwardBatch, conv: jax.Array, rec: jax.Array, layer: jax.Array | int,
                      conv_s: jax.Array, rec_s: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The pools with each row's new state (as :func:`slot_states` returns them) written to its slot."""
    conv = scatter_windows(conv, layer, batch.slot_ids, jnp.swapaxes(conv_s, 1, 2))
    return conv, rec.at[layer, batch.slot_ids].set(rec_s.astype(rec.dtype))


def gdn_layer_verify(
    p: dict[str, Any],
    x: jax.Array,
    batch: ForwardBatch,
    conv: jax.Array,
    rec: jax.Array,
    layer: jax.Array | int,
    config: Qwen35MoeConfig,
    recurrent: bool = False,
    matmul: MoeBackend | None = None,
) -> tuple[jax.Array, tuple[jax.Array, jax.Array, jax.Array]]:
    """:func:`gdn_layer` over each row's slot state for a speculative verify step, writing nothing back.

    Args: as :func:`gdn_layer_on_pools`.

    Returns:
        ``(out [B, T, H], (mixed [B, T, conv_dim], g [B, T, Hv], beta [B, T, Hv]))``: the layer's output and
        the inputs of its conv1d + delta rule, from which model/forward.py ``commit_gdn_states`` recomputes the
        state after the accepted tokens.
    """
    conv_s, rec_s = slot_states(batch, conv, rec, layer, config)
    mixed, z, g, beta = gdn_projections(p, x, batch.valid, config, matmul)
    o, _, _ = gdn_mix(mixed, p["conv1d"], g, beta, conv_s, rec_s, batch.valid, batch.extend_lens, config, recurrent)
    return gdn_output(p, o, z, x.dtype, config, matmul), (mixed, g, beta)
