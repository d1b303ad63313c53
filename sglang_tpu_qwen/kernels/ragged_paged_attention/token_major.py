"""The reference backend's KV pool layout, token-major: ``[L, num_pages, page_size / r, r * nkv, hd]``.

A page holds ``page_size`` tokens of ``nkv`` heads x ``hd``. Logically that is ``[page_size, nkv, hd]``; it is
stored as the row-major reshape ``[page_size / r, r * nkv, hd]`` (``r`` consecutive tokens per row: token ``t``,
head ``h`` sit at row ``t // r``, sublane ``(t % r) * nkv + h``), so the two views share their bytes. The jnp
reference writes one token into it in place on every platform.

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
from dataclasses import dataclass
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from sglang_tpu_qwen.kernels.ragged_paged_attention.kv_quant import is_fp8
from sglang_tpu_qwen.kernels.ragged_paged_attention.layout import KVPoolLayout

_FP8_PACKING = 4  # 1-byte elements per 32-bit sublane word


def tokens_per_row(dtype: Any, nkv: int) -> int:
    """``r``: tokens stored per pool row (1 unless ``dtype`` is FP8; then ``r * nkv`` is a multiple of 4)."""
    if not is_fp8(dtype):
        return 1
    return _FP8_PACKING // math.gcd(nkv, _FP8_PACKING)


@dataclass(frozen=True)
class TokenMajorLayout(KVPoolLayout):
    """``[L, N, page_size / r, r * nkv, hd]``, ``r = tokens_per_row(dtype, nkv)`` (module docstring)."""

    name: ClassVar[str] = "token_major"

    def pool_shape(self, layers: int, num_pages: int, page_size: int, nkv: int, hd: int,
                   dtype: Any) -> tuple[int, ...]:
        """Stored shape. Raises ValueError when ``page_size`` is not a multiple of ``r``."""
        r = tokens_per_row(dtype, nkv)
        if page_size % r:
            raise ValueError(f"page size {page_size} must be a multiple of {r} for a {jnp.dtype(dtype).name} "
                             f"KV cache with {nkv} KV heads (tokens packed per 32-bit sublane row)")
        return layers, num_pages, page_size // r, r * nkv, hd

    def page_size_of(self, pool: Any, nkv: int) -> int:
        """``rows * r``: the rows of a page times the tokens per row."""
        return pool.shape[2] * pool.shape[3] // nkv

    def logical(self, pool: jax.Array, nkv: int) -> jax.Array:
        """A row-major reshape: no data moves."""
        layers, pages, _, _, hd = pool.shape
        return pool.reshape(layers, pages, self.page_size_of(pool, nkv), nkv, hd)

    def stored(self, view: jax.Array) -> jax.Array:
        return view.reshape(self.pool_shape(*view.shape, view.dtype))

    def page_multiple(self, dtype: Any) -> int:
        """The largest ``r`` (one KV head): 4 for FP8, 1 otherwise."""
        return tokens_per_row(dtype, 1)

    def head_axis(self, dtype: Any, nkv: int) -> int | None:
        return 3 if tokens_per_row(dtype, nkv) == 1 else None

    def gather_tokens(self, pool: jax.Array, pages: jax.Array, offsets: jax.Array, nkv: int) -> jax.Array:
        # The rows are gathered in the stored shape: a reshape of the whole pool would be a relayout copy on TPU.
        per_row = tokens_per_row(pool.dtype, nkv)
        rows, sub = offsets // per_row, offsets % per_row
        got = pool[:, pages, rows]  # [L, n, r * nkv, hd]
        got = got.reshape(got.shape[0], got.shape[1], per_row, -1, got.shape[-1])
        return jnp.take_along_axis(got, sub[None, :, None, None, None], axis=2)[:, :, 0]

    def write_pages(self, pool: jax.Array, pages: jax.Array, tokens: jax.Array) -> jax.Array:
        # Whole pages in the stored shape: a packed FP8 page is a row-major reshape of its tokens.
        page_shape = (tokens.shape[0], pages.shape[0], *pool.shape[2:])
        return pool.at[:, pages].set(tokens.reshape(page_shape))


TOKEN_MAJOR = TokenMajorLayout()
