"""A head-major KV pool layout: ``[L, num_pages, nkv, page_size, hd]``.

Each KV head's page is one contiguous ``[page_size, hd]`` block, so a kernel that streams one head's pages
reads whole tiles of page tokens (the sublane dim) instead of ``nkv``-row slivers, and an FP8 pool needs no
packing (the second-minor dim is the page size). The Pallas ragged paged attention (kernel.py) reads this
layout and writes a step's new tokens a tile-aligned block at a time (``kernel.write_new_kv``); :meth:`write_tokens`
here, the jnp reference's per-token scatter, is right on any platform but on a TPU makes XLA copy the pool into
a layout with the token dim outside the tile (the reference backend therefore defaults to token-major). On a
TPU the page size must be a multiple of the dtype's sublane tile (8 for float32, 16 for bf16, 32 for FP8).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from sglang_tpu_qwen.kernels.ragged_paged_attention.layout import KVPoolLayout


@dataclass(frozen=True)
class HeadMajorLayout(KVPoolLayout):
    """``[L, N, nkv, page_size, hd]``; the logical view swaps axes 2 and 3 (a transpose)."""

    name: ClassVar[str] = "head_major"

    def pool_shape(self, layers: int, num_pages: int, page_size: int, nkv: int, hd: int,
                   dtype: Any) -> tuple[int, ...]:
        """Stored shape (any page size). ``dtype`` is accepted for the common signature."""
        del dtype
        return layers, num_pages, nkv, page_size, hd

    def page_size_of(self, pool: Any, nkv: int) -> int:
        del nkv
        return pool.shape[3]

    def logical(self, pool: jax.Array, nkv: int) -> jax.Array:
        del nkv
        return jnp.swapaxes(pool, 2, 3)

    def stored(self, view: jax.Array) -> jax.Array:
        return jnp.swapaxes(view, 2, 3)

    def head_axis(self, dtype: Any, nkv: int) -> int | None:
        return 2

    def page_reader(self, pool: jax.Array, nkv: int) -> Callable[[jax.Array | int, jax.Array], jax.Array]:
        # Gather the pages first, then transpose only what was read (not the whole pool).
        return lambda layer, pages: jnp.swapaxes(pool[layer, pages], -3, -2)

    def write_tokens(self, pool: jax.Array, layer: jax.Array | int, new: jax.Array, pages: jax.Array,
                     offsets: jax.Array) -> jax.Array:
        # Advanced indices split by the head slice: the indexed dims [B, T] lead, then [nkv, hd], as ``new``.
        return pool.at[jnp.asarray(layer), pages, :, offsets].set(new)

    def gather_tokens(self, pool: jax.Array, pages: jax.Array, offsets: jax.Array, nkv: int) -> jax.Array:
        del nkv
        return jnp.moveaxis(pool[:, pages, :, offsets], 0, 1)  # [n, L, nkv, hd] -> [L, n, nkv, hd]

    def write_pages(self, pool: jax.Array, pages: jax.Array, tokens: jax.Array) -> jax.Array:
        layers, _, nkv, page_size, hd = pool.shape
        pages_view = tokens.reshape(layers, pages.shape[0], page_size, nkv, hd)
        return pool.at[:, pages].set(jnp.swapaxes(pages_view, 2, 3))


HEAD_MAJOR = HeadMajorLayout()
