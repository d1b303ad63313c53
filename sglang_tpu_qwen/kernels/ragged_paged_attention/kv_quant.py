"""FP8 KV pages: how K and V are stored in a float8_e4m3fn cache and read back.

SGLang's and vLLM's FP8 KV cache with per-tensor scales: a cache in ``float8_e4m3fn`` holds ``x / scale``
cast with saturation (e4m3fn has no infinity: an unclipped value past 448 would become NaN), and a read
dequantises ``q * scale``. ``scale`` is one float32 per attention layer for K and one for V: the checkpoint's
``k_scale`` / ``v_scale`` when it has them, else 1.0 (SGLang's default). A cache in any other dtype stores
``x`` cast to it and ignores the scales, so the bf16 / float32 paths are unchanged.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

FP8_KV_DTYPE = jnp.dtype(jnp.float8_e4m3fn)
FP8_MAX = float(jnp.finfo(FP8_KV_DTYPE).max)  # 448


def is_fp8(dtype: Any) -> bool:
    """Whether a cache of ``dtype`` holds scaled FP8 pages (static: a dtype, not a traced value)."""
    return jnp.dtype(dtype) == FP8_KV_DTYPE


def scale_or_one(scale: Any) -> jax.Array:
    """A layer's K or V scale as a float32 scalar; None (no scale in the checkpoint) is 1.0."""
    return jnp.asarray(1.0 if scale is None else scale, jnp.float32).reshape(())


def quantize_kv(x: jax.Array, dtype: Any, scale: Any = None) -> jax.Array:
    """New keys or values as a cache of ``dtype`` stores them.

    Args:
        x: ``[..., hd]`` keys or values, any float dtype.
        dtype: the cache dtype.
        scale: float32 scalar (or None = 1.0), read only when ``dtype`` is FP8.

    Returns:
        ``x`` in ``dtype``; for FP8 ``clip(x / scale, -448, 448)`` cast to ``float8_e4m3fn`` (round to nearest).
    """
    if not is_fp8(dtype):
        return x.astype(dtype)
    y = x.astype(jnp.float32) / scale_or_one(scale)
    return jnp.clip(y, -FP8_MAX, FP8_MAX).astype(dtype)


def dequantize_kv(q: jax.Array, scale: Any = None, dtype: Any = jnp.float32) -> jax.Array:
    """``q * scale`` in ``dtype`` for an FP8 page (the values the attention reads); other dtypes just cast."""
    if not is_fp8(q.dtype):
        return q.astype(dtype)
    return (q.astype(jnp.float32) * scale_or_one(scale)).astype(dtype)
