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
