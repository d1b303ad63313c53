"""Device side of a transfer: read one request's state out of the paged cache, write it into another.

KV leaves token-major (`[n_attn, tokens, kv_heads, head_dim]`), so the receiving server re-pages it with
its own page size and its own pool layout. How the pools are stored is asked of the layouts the runner's
backends name (`KVPoolLayout` for `k`/`v`, kernels/ragged_paged_attention/layout.py; `GdnStateLayout` for
`conv`/`rec`, kernels/gdn/state_layout.py), never read off shapes by position. Reads return fresh device
arrays (a later step donating the cache does not touch them); writes are one jitted scatter with the cache
donated, keeping the cache's sharding. Shapes are padded to powers of two so the number of compilations
stays small.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from sglang_tpu_qwen.kernels.gdn.state_layout import GDN_STATE_LAYOUT, GdnStateLayout
from sglang_tpu_qwen.kernels.ragged_paged_attention.layout import KVPoolLayout
from sglang_tpu_qwen.utils.shapes import next_pow2


@partial(jax.jit, static_argnames=("layout", "nkv"))
def _gather(k: jax.Array, v: jax.Array, page_ids: jax.Array, offsets: jax.Array, layout: KVPoolLayout,
            nkv: int) -> tuple[jax.Array, jax.Array]:
    """Tokens at (page, offset) of both pools, ``[L, n, nkv, hd]`` each (``layout.gather_tokens``)."""
    return layout.gather_tokens(k, page_ids, offsets, nkv), layout.gather_tokens(v, page_ids, offsets, nkv)


def gather_kv(cache: dict, layout: KVPoolLayout, nkv: int, pages: list[int], start: int,
              end: int) -> tuple[jax.Array, jax.Array]:
    """KV of token positions [start, end) of a sequence whose page table is `pages`.

    Args:
        cache: the runner's cache; `k`, `v` stored as `layout` says, with `nkv` KV heads.
        pages: the sequence's page ids; start, end: the token range.

    Returns (k, v), each `[n_attn, end - start, kv_heads, head_dim]` in the cache dtype, on the cache's
    devices. Raises ValueError when the pages do not cover `end` tokens.
    """
    page_size = layout.page_size_of(cache["k"], nkv)
    if not 0 <= start < end or end > len(pages) * page_size:
        raise ValueError(f"token range [{start}, {end}) not covered by {len(pages)} pages of {page_size}")
    n = end - start
    size = next_pow2(n, 16)
    pos = np.arange(start, start + size)
    table = np.asarray(pages, np.int32)
    page_ids = np.where(pos < end, table[np.minimum(pos, end - 1) // page_size], 0).astype(np.int32)
    offsets = np.where(pos < end, pos % page_size, 0).astype(np.int32)
    k, v = _gather(cache["k"], cache["v"], jnp.asarray(page_ids), jnp.asarray(offsets), layout, nkv)
    return k[:, :n], v[:, :n]


def read_gdn(cache: dict, slot: int, layout: GdnStateLayout = GDN_STATE_LAYOUT) -> tuple[jax.Array, jax.Array]:
    """GDN state of one slot: (conv [n_gdn, conv_dim, K-1], rec [n_gdn, Hv, dk, dv]) device arrays
    (``layout.read_slot``)."""
    return layout.read_slot(cache["conv"], cache["rec"], slot)


def _scatter_impl(cache: dict, pages: jax.Array, k_tok: jax.Array, v_tok: jax.Array, *,
                  layout: KVPoolLayout) -> dict:
    out = dict(cache)
    out["k"] = layout.write_pages(cache["k"], pages, k_tok)
    out["v"] = layout.write_pages(cache["v"], pages, v_tok)
    return out


def _write_gdn_impl(cache: dict, slot: jax.Array, conv: jax.Array, rec: jax.Array, *,
                    layout: GdnStateLayout) -> dict:
    out = dict(cache)
    out["conv"], out["rec"] = layout.write_slot(cache["conv"], cache["rec"], slot, conv, rec)
    return out


_JITTED: dict[tuple, Any] = {}


def _jit_for(cache: dict, impl: Any, layout: Any) -> Any:
    """`impl` with `layout` bound, jitted with the cache donated and its output kept on the cache's shardings
    (the scheduler's arrays stay where they are); one compilation cache entry per (impl, layout, shardings)."""
    key = (impl, layout, *((name, cache[name].sharding) for name in sorted(cache)))
    fn = _JITTED.get(key)
    if fn is None:
        shardings = {name: cache[name].sharding for name in cache}
        fn = _JITTED[key] = jax.jit(partial(impl, layout=layout), donate_argnums=(0,), out_shardings=shardings)
    return fn


def input_placement(cache: dict) -> jax.sharding.Sharding:
    """Where arrays fed to `write_kv` / `write_gdn` should live: replicated over the cache's devices."""
    sharding = cache["k"].sharding
    if isinstance(sharding, jax.sharding.NamedSharding):
        return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
    return jax.sharding.SingleDeviceSharding(next(iter(sharding.device_set)))


def write_kv(cache: dict, layout: KVPoolLayout, pages: list[int], k: Any, v: Any) -> dict:
    """Write token-major KV of positions [0, T) into `pages` (enough to hold T tokens); returns the cache.

    cache: `k`, `v` stored as `layout` says. k, v: `[n_attn, T, kv_heads, head_dim]`, host numpy or device
    arrays placed by `input_placement`. Positions past T in the last page are zero-filled (a later step
    overwrites them before reading). Raises ValueError when the pages cannot hold T tokens.
    """
    page_size = layout.page_size_of(cache["k"], k.shape[2])
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
    return _jit_for(cache, _scatter_impl, layout)(cache, jnp.asarray(table), jax.device_put(k, place),
                                                  jax.device_put(v, place))


@partial(jax.jit, static_argnums=(1,))
def _pad_device(x: jax.Array, pad: int) -> jax.Array:
    return jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0)))


def write_gdn(cache: dict, slot: int, conv: Any, rec: Any, layout: GdnStateLayout = GDN_STATE_LAYOUT) -> dict:
    """Write one request's GDN state (shapes as `read_gdn` returns) into `slot`; returns the cache."""
    place = input_placement(cache)
    return _jit_for(cache, _write_gdn_impl, layout)(cache, jnp.asarray(slot, jnp.int32), jax.device_put(conv, place),
                                            jax.device_put(rec, place))
