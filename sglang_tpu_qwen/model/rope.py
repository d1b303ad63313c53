"""Partial rotary position embedding (rotate-half convention), as in HF ``Qwen3_5MoeTextRotaryEmbedding``.

For text-only input the three M-RoPE position streams are equal, so M-RoPE reduces to plain RoPE on the
first ``rotary_dim`` dims of each head (Su et al., "RoFormer", 2021).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


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


# HF Qwen3_5TextRotaryEmbedding's mrope_section when the config names none.
DEFAULT_MROPE_SECTION = (11, 11, 10)


def mrope_streams(rotary_dim: int, section: tuple[int, ...]) -> np.ndarray:
    """Which position stream (0 time, 1 height, 2 width) drives each of the ``rotary_dim / 2`` frequencies.

    Interleaved, as HF ``Qwen3_5TextRotaryEmbedding.recomposition_frequencies`` always lays them out (it reads no
    ``mrope_interleaved`` flag): frequency ``j`` takes height when ``j % 3 == 1 and j < 3 * section[1]``, width
    when ``j % 3 == 2 and j < 3 * section[2]``, else time.
    """
    streams = np.zeros(rotary_dim // 2, np.int32)
    for dim in (1, 2):
        streams[dim : 3 * section[dim] : 3] = dim
    return streams


def mrope_cos_sin(positions: jax.Array, rotary_dim: int, theta: float,
                  section: tuple[int, ...] | None) -> tuple[jax.Array, jax.Array]:
    """Cos/sin tables for 3-D M-RoPE positions (HF ``Qwen3_5TextRotaryEmbedding``).

    Args:
        positions: ``[B, T, 3]`` int32 (time, height, width) position of each token.
        rotary_dim, theta: as :func:`rope_cos_sin`.
        section: ``mrope_section``, frequencies per stream (:func:`mrope_streams`); None: HF's default
            ``DEFAULT_MROPE_SECTION``.

    Returns:
        ``(cos, sin)``, each ``[B, T, rotary_dim]`` float32; equal, bit for bit, to :func:`rope_cos_sin` of
        ``positions[..., 0]`` when the three streams are equal (text).
    """
    streams = mrope_streams(rotary_dim, section or DEFAULT_MROPE_SECTION)
    inv_freq = 1.0 / (theta ** (jnp.arange(0, rotary_dim, 2, dtype=jnp.float32) / rotary_dim))
    picked = positions[..., jnp.asarray(streams)]  # [B, T, rd / 2]
    freqs = picked.astype(jnp.float32) * inv_freq
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
