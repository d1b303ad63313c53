"""Device side of a transfer: read one request's state out of the paged cache, write it into another.

KV leaves token-major (`[n_attn, tokens, kv_heads, head_dim]`), so the receiving server re-pages it with
its own page size. Reads return fresh device arrays (a later step donating the cache does not touch them);
writes are one jitted scatter with the cache donated, keeping the cache's sharding. Shapes are padded to
powers of two so the number of compilations stays small.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from sglang_tpu_qwen.kernels.gdn import conv_pool
from sglang_tpu_qwen.kernels.ragged_paged_attention.page_layout import page_size_of
from sglang_tpu_qwen.utils.shapes import next_pow2


@partial(jax.jit, static_argnames=("per_row",))
def _gather(k: jax.Array, v: jax.Array, page_ids: jax.Array, offsets: jax.Array,
            per_row: int) -> tuple[jax.Array, jax.Array]:
    """Tokens at (page, offset) from pools stored with ``per_row`` tokens per row (page_layout.py): the rows
    are gathered in the stored shape (a reshape of the whole pool would be a relayout copy on TPU)."""
    rows, sub = offsets // per_row, offsets % per_row

    def one(pool: jax.Array) -> jax.Array:
        got = pool[:, page_ids, rows]  # [L, n, r * nkv, hd]
        got = got.reshape(got.shape[0], got.shape[1], per_row, -1, got.shape[-1])
        return jnp.take_along_axis(got, sub[None, :, None, None, None], axis=2)[:, :, 0]

    return one(k), one(v)


def gather_kv(cache: dict, pages: list[int], page_size: int, start: int, end: int) -> tuple[jax.Array, jax.Array]:
    """KV of token positions [start, end) of a sequence whose page table is `pages`.

    Returns (k, v), each `[n_attn, end - start, kv_heads, head_dim]` in the cache dtype, on the cache's
    devices. Raises ValueError when the pages do not cover `end` tokens.
    """
    if not 0 <= start < end or end > len(pages) * page_size:
        raise ValueError(f"token range [{start}, {end}) not covered by {len(pages)} pages of {page_size}")
    n = end - start
    size = next_pow2(n, 16)
    pos = np.arange(start, start + size)
    table = np.asarray(pages, np.int32)
    page_ids = np.where(pos < end, table[np.minimum(pos, end - 1) // page_size], 0).astype(np.int32)
    offsets = np.where(pos < end, pos % page_size, 0).astype(np.int32)
    per_row = page_size // cache["k"].shape[2]
    k, v = _gather(cache["k"], cache["v"], jnp.asarray(page_ids), jnp.asarray(offsets), per_row)
    return k[:, :n], v[:, :n]


def read_gdn(cache: dict, slot: int) -> tuple[jax.Array, jax.Array]:
    """GDN state of one slot: (conv [n_gdn, conv_dim, K-1], rec [n_gdn, Hv, dk, dv]) device arrays."""
    taps = conv_pool.taps_of(cache["conv"], cache["rec"].shape[1])
    return conv_pool.read_slot(cache["conv"], slot, taps), cache["rec"][:, slot]


def _scatter_impl(cache: dict, pages: jax.Array, k_tok: jax.Array, v_tok: jax.Array) -> dict:
    # Whole pages in the stored shape (page_layout.py: a packed FP8 page is a row-major reshape of the tokens).
    page_shape = (k_tok.shape[0], pages.shape[0], *cache["k"].shape[2:])
    out = dict(cache)
    out["k"] = cache["k"].at[:, pages].set(k_tok.reshape(page_shape))
    out["v"] = cache["v"].at[:, pages].set(v_tok.reshape(page_shape))
    return out


def _write_gdn_impl(cache: dict, slot: jax.Array, conv: jax.Array, rec: jax.Array) -> dict:
    out = dict(cache)
    out["conv"] = conv_pool.write_slot(cache["conv"], slot, conv)
    out["rec"] = cache["rec"].at[:, slot].set(rec.astype(cache["rec"].dtype))
    return out


_JITTED: dict[tuple, Any] = {}


def _jit_for(cache: dict, impl: Any) -> Any:
    """`impl` jitted with the cache donated and its output kept on the cache's shardings (the scheduler's
    arrays stay where they are); one compilation cache entry per (impl, shardings)."""
    key = (impl, *((name, cache[name].sharding) for name in sorted(cache)))
    fn = _JITTED.get(key)
    if fn is None:
        shardings = {name: cache[name].sharding for name in cache}
        fn = _JITTED[key] = jax.jit(impl, donate_argnums=(0,), out_shardings=shardings)
    return fn


def input_placement(cache: dict) -> jax.sharding.Sharding:
    """Where arrays fed to `write_kv` / `write_gdn` should live: replicated over the cache's devices."""
    sharding = cache["k"].sharding
    if isinstance(sharding, jax.sharding.NamedSharding):
        return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
    return jax.sharding.SingleDeviceSharding(next(iter(sharding.device_set)))


def write_kv(cache: dict, pages: list[int], k: Any, v: Any) -> dict:
    """Write token-major KV of positions [0, T) into `pages` (enough to hold T tokens); returns the cache.

    k, v: `[n_attn, T, kv_heads, head_dim]`, host numpy or device arrays placed by `input_placement`.
    Positions past T in the last page are zero-filled (a later step overwrites them before reading).
    """
    page_size = page_size_of(cache["k"], k.shape[2])
    num_tokens = k.shape[1]
    if len(pages) * page_size < num_tokens:
        raise ValueError(f"{len(pages)} pages of {page_size} cannot hold {num_tokens} tokens")
    num_pages = next_pow2(max(1, -(-num_tokens // page_size)), 4)
    table = np.zeros(num_pages, np.int32)  # padding targets page 0, the trash page
    used = -(-num_tokens // page_size)
    table[:used] = pages[:used]
    pad = num_pages * page_size - num_tokens
    widths = ((0, 0), (0, pad), (0, 0), (0, 0))
    if isinstance(k, np.ndarray):
        k, v = np.pad(k, widths), np.pad(v, widths)
    else:
        k, v = _pad_device(k, pad), _pad_device(v, pad)
    place = input_placement(cache)
    return _jit_for(cache, _scatter_impl)(cache, jnp.asarray(table), jax.device_put(k, place),
                                          jax.device_put(v, place))


@partial(jax.jit, static_argnums=(1,))
def _pad_device(x: jax.Array, pad: int) -> jax.Array:
    return jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0)))


def write_gdn(cache: dict, slot: int, conv: Any, rec: Any) -> dict:
    """Write one request's GDN state (shapes as `read_gdn` returns) into `slot`; returns the cache."""
    place = input_placement(cache)
    return _jit_for(cache, _write_gdn_impl)(cache, jnp.asarray(slot, jnp.int32), jax.device_put(conv, place),
                                            jax.device_put(rec, place))
