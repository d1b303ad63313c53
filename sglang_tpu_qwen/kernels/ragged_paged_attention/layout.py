"""How a K or V page pool is stored: the one place that knows the axes of ``cache["k"]`` / ``cache["v"]``.

Every pool has the same *logical* view, ``[L, num_pages, page_size, nkv, hd]`` (layer, page, token of the
page, KV head, head dim); a :class:`KVPoolLayout` says how that view is laid out in the stored array and
answers every question other code would otherwise answer by indexing ``pool.shape`` by position: the stored
shape, the page size of a pool, the logical view and its inverse, the token reads and page writes of a
transfer (memory/kv_io.py), the axis holding pages (split over the DP ranks, parallel/sharding.py) and the
axis holding KV heads, and the bytes of a token or a page (engine/runner/memory_accounting.py).

The attention backend (kernels/attention_backend.py) names the layout its kernel reads; the jnp reference
runs on any layout. Implementations: :class:`token_major.TokenMajorLayout` (``[L, N, page/r, r * nkv, hd]``,
FP8 packed; the reference backend's) and :class:`head_major.HeadMajorLayout` (``[L, N, nkv, page_size, hd]``;
the Pallas kernel's).

A layout is a frozen dataclass with no array state: it is static configuration of the jitted step (hashable,
compared by value). Where a stored shape cannot tell the KV head count (a packed FP8 pool), methods take it.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

# The pool axis holding pages in every layout: DP attention splits it over the batch axes (each rank owns a
# block of pages) and a page table indexes it.
PAGE_AXIS = 1


@dataclass(frozen=True)
class KVPoolLayout(abc.ABC):
    """The stored form of a ``[L, num_pages, page_size, nkv, hd]`` K or V pool (see module docstring).

    Shapes below: ``L`` layers (attention layers plus MTP layers), ``N`` pages, ``nkv`` KV heads of ``hd``.
    Stored pools are what ``init_cache`` allocates; views are always ``[L, N, page_size, nkv, hd]``.
    """

    name: ClassVar[str]
    page_axis: ClassVar[int] = PAGE_AXIS

    @abc.abstractmethod
    def pool_shape(self, layers: int, num_pages: int, page_size: int, nkv: int, hd: int,
                   dtype: Any) -> tuple[int, ...]:
        """Stored shape of a pool of ``dtype``. Raises ValueError when ``page_size`` does not fit the layout."""

    @abc.abstractmethod
    def page_size_of(self, pool: Any, nkv: int) -> int:
        """Tokens per page of a stored pool (an array or ShapeDtypeStruct) of ``nkv`` KV heads."""

    @abc.abstractmethod
    def logical(self, pool: jax.Array, nkv: int) -> jax.Array:
        """The ``[L, N, page_size, nkv, hd]`` view of a stored pool (a reshape or a transpose)."""

    def logical_shape(self, pool: Any, nkv: int) -> tuple[int, ...]:
        """``(L, num_pages, page_size, nkv, hd)`` of a stored pool (an array or ShapeDtypeStruct; no data)."""
        abstract = jax.ShapeDtypeStruct(pool.shape, pool.dtype)
        return tuple(jax.eval_shape(lambda p: self.logical(p, nkv), abstract).shape)

    @abc.abstractmethod
    def stored(self, view: jax.Array) -> jax.Array:
        """A ``[L, N, page_size, nkv, hd]`` view back in the stored shape (inverse of :meth:`logical`)."""

    def page_multiple(self, dtype: Any) -> int:
        """What every page size of a ``dtype`` pool must be a multiple of, for any KV head count (a flag check
        that runs before the model config is read); 1 by default."""
        del dtype
        return 1

    @abc.abstractmethod
    def head_axis(self, dtype: Any, nkv: int) -> int | None:
        """Axis of the stored pool that holds exactly the KV heads (what a head split would shard), or None
        where heads share an axis with tokens (a packed FP8 token-major pool)."""

    def page_reader(self, pool: jax.Array, nkv: int) -> Callable[[jax.Array | int, jax.Array], jax.Array]:
        """``read(layer, pages [...]) -> [..., page_size, nkv, hd]`` (pool dtype): how the jnp reference reads
        a block of pages inside its loop. The default takes the logical view once, outside the loop."""
        view = self.logical(pool, nkv)
        return lambda layer, pages: view[layer, pages]

    def write_tokens(self, pool: jax.Array, layer: jax.Array | int, new: jax.Array, pages: jax.Array,
                     offsets: jax.Array) -> jax.Array:
        """``pool`` with token ``offsets[b, t]`` of page ``pages[b, t]`` of layer ``layer`` set to ``new[b, t]``.

        Args:
            pool: stored pool. new: ``[B, T, nkv, hd]`` already in the pool dtype (kv_quant.quantize_kv).
            pages, offsets: ``[B, T]`` int32.

        Returns:
            The pool, same stored shape and dtype.
        """
        return self.stored(self.logical(pool, new.shape[2]).at[layer, pages, offsets].set(new))

    @abc.abstractmethod
    def gather_tokens(self, pool: jax.Array, pages: jax.Array, offsets: jax.Array, nkv: int) -> jax.Array:
        """Every layer's token at ``(pages[i], offsets[i])``: ``pages, offsets [n]`` int32 -> ``[L, n, nkv, hd]``
        in the pool dtype (the KV a PD transfer sends, memory/kv_io.py). Reads only the addressed pages."""

    @abc.abstractmethod
    def write_pages(self, pool: jax.Array, pages: jax.Array, tokens: jax.Array) -> jax.Array:
        """``pool`` with whole pages ``pages [n]`` of every layer set from ``tokens [L, n * page_size, nkv, hd]``
        (token ``i`` to page ``pages[i // page_size]``, offset ``i % page_size``); cast to the pool dtype."""

    def token_bytes(self, nkv: int, hd: int, dtype: Any) -> int:
        """Bytes one token of one layer takes in a K (or V) pool."""
        return nkv * hd * jnp.dtype(dtype).itemsize

    def page_bytes(self, page_size: int, nkv: int, hd: int, dtype: Any) -> int:
        """Bytes one page of one layer takes in a K (or V) pool (the stored page: no padding in any layout)."""
        return page_size * self.token_bytes(nkv, hd, dtype)
