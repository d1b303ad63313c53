"""How a K or V page pool is shaped in memory: ``[L, num_pages, page_size / r, r * nkv, hd]``.

A page holds ``page_size`` tokens of ``nkv`` heads x ``hd``. Logically that is ``[page_size, nkv, hd]``; it is
stored as the row-major reshape ``[page_size / r, r * nkv, hd]`` (``r`` consecutive tokens per row: token ``t``,
head ``h`` sit at row ``t // r``, sublane ``(t % r) * nkv + h``), so the two views share their bytes.

Why: TPU packs ``4 / itemsize`` elements of a sub-32-bit dtype into one 32-bit sublane word, so XLA tiles an
8-bit array's two minor dims by (4|8|32, 128). When the second-minor dim is smaller than that packing (FP8
with ``nkv = 2``: 2 < 4), XLA's default layout for the pool permutes the dims (``{4,2,3,1,0:T(32,128)}``:
page tokens become the sublane dim) while the Mosaic kernel asks for the row-major ``T(4,128)`` layout, so XLA
copied the whole pool into the kernel's layout and back on every call (2 x the pool in temporaries). With
``r * nkv`` a multiple of the packing the default layout is row-major and matches the kernel's (docs/internals.md).
bf16 / float32 pools keep ``r = 1`` (their layout already matched for ``nkv >= 2``).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from sglang_tpu_qwen.kernels.ragged_paged_attention.kv_quant import is_fp8

_FP8_PACKING = 4  # 1-byte elements per 32-bit sublane word


def tokens_per_row(dtype: Any, nkv: int) -> int:
    """``r``: tokens stored per pool row (1 unless ``dtype`` is FP8; then ``r * nkv`` is a multiple of 4)."""
    if not is_fp8(dtype):
        return 1
    return _FP8_PACKING // math.gcd(nkv, _FP8_PACKING)


def pool_shape(layers: int, num_pages: int, page_size: int, nkv: int, hd: int, dtype: Any) -> tuple[int, ...]:
    """Stored shape of a K or V pool. Raises ValueError when ``page_size`` is not a multiple of ``r``."""
    r = tokens_per_row(dtype, nkv)
    if page_size % r:
        raise ValueError(f"page size {page_size} must be a multiple of {r} for a {jnp.dtype(dtype).name} "
                         f"KV cache with {nkv} KV heads (tokens packed per 32-bit sublane row)")
    return layers, num_pages, page_size // r, r * nkv, hd


def page_size_of(pool: Any, nkv: int) -> int:
    """Tokens per page of a stored pool (``shape[2] * r``)."""
    return pool.shape[2] * pool.shape[3] // nkv


def logical(pool: jax.Array, nkv: int) -> jax.Array:
    """The ``[L, num_pages, page_size, nkv, hd]`` view of a stored pool (a row-major reshape: no data moves)."""
    layers, pages, _, _, hd = pool.shape
    return pool.reshape(layers, pages, page_size_of(pool, nkv), nkv, hd)


def stored(pool: jax.Array) -> jax.Array:
    """A ``[L, num_pages, page_size, nkv, hd]`` pool back in its stored shape (inverse of :func:`logical`)."""
    return pool.reshape(pool_shape(*pool.shape, pool.dtype))
