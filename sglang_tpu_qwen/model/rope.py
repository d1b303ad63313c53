"""Partial rotary position embedding (rotate-half convention), as in HF ``Qwen3_5MoeTextRotaryEmbedding``.

For text-only input the three M-RoPE position streams are equal, so M-RoPE reduces to plain RoPE on the
first ``rotary_dim`` dims of each head (Su et al., "RoFormer", 2021).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rope_cos_sin(positions: jax.Array, rotary_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """Cos/sin tables for integer positions.

    Args:
        positions: ``[...]`` int32 token positions.
        rotary_dim: even number of rotated dims per head.
        theta: RoPE base.

    Returns:
        ``(cos, sin)``, each ``[..., rotary_dim]`` float32, laid out as ``concat(freqs, freqs)``.
    """
    inv_freq = 1.0 / (theta ** (jnp.arange(0, rotary_dim, 2, dtype=jnp.float32) / rotary_dim))
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate the first ``rotary_dim`` dims of every head; the rest pass through.

    Args:
        x: ``[B, T, N, hd]``.
        cos, sin: ``[B, T, rotary_dim]`` float32 from :func:`rope_cos_sin`.

    Returns:
        ``[B, T, N, hd]`` in ``x.dtype``: ``x_rot * cos + rotate_half(x_rot) * sin``, where
        ``rotate_half([a, b]) = [-b, a]``.
    """
    rd = cos.shape[-1]
    cos = cos[:, :, None, :].astype(x.dtype)
    sin = sin[:, :, None, :].astype(x.dtype)
    x_rot, x_pass = x[..., :rd], x[..., rd:]
    x1, x2 = x_rot[..., : rd // 2], x_rot[..., rd // 2 :]
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return jnp.concatenate([x_rot * cos + rotated * sin, x_pass], axis=-1)
