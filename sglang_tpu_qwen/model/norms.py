"""Normalisations used by Qwen3.5-MoE (reference: HF ``modeling_qwen3_5_moe.py``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """Zero-centred RMSNorm: ``x / rms(x) * (1 + w)``, computed in float32.

    Args:
        x: ``[..., D]`` any float dtype.
        weight: ``[D]`` the HF weight ``w`` (initialised at 0, so the scale starts at 1).
        eps: added to the mean square.

    Returns:
        ``[..., D]`` in ``x.dtype``. Matches ``Qwen3_5MoeRMSNorm`` (the product is taken in fp32, then cast).
    """
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)


def gated_rms_norm(x: jax.Array, gate: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """Gated RMSNorm of the Gated DeltaNet output: ``w * (x / rms(x)) * silu(gate)``.

    Args:
        x: ``[..., D]`` core output per head.
        gate: ``[..., D]`` the ``z`` projection for the same head.
        weight: ``[D]`` applied as a plain multiplier (not ``1 + w``).
        eps: added to the mean square.

    Returns:
        ``[..., D]`` in ``x.dtype``. Matches ``Qwen3_5MoeRMSNormGated`` (norm in fp32, cast, scale, gate in fp32).
    """
    dtype = x.dtype
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    y = weight * xf.astype(dtype)
    y = y.astype(jnp.float32) * jax.nn.silu(gate.astype(jnp.float32))
    return y.astype(dtype)


def l2_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """``x * rsqrt(sum(x^2) + eps)`` over the last axis (the FLA / HF ``l2norm`` convention), same dtype."""
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)
