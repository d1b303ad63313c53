"""The GDN conv-state pool: every GDN layer's causal-conv window for every state slot, in one array.

Layout: ``[n_gdn_layers, num_slots * (K-1), conv_dim / LANES, LANES]`` (``LANES`` = 128 when it divides
``conv_dim``, else ``conv_dim``): slot ``s`` owns the ``K-1`` consecutive rows ``[s * (K-1), (s+1) * (K-1))``,
oldest input first, each row all ``conv_dim`` channels. A row is a leading index whose channels fill whole
(8, 128) tiles, so a step's gather and scatter of its slots' rows move contiguous tiles. In the 3-D form
``[L, S * (K-1), conv_dim]`` a row was one sublane of every tile it crossed: on the v5e its scatter ran at
32-38 GB/s (0.66 ms a GDN layer at 256 rows of the 35B-shaped model, 0.24 ms in this form; dev bench
``conv_scatter``). Why not ``[L, S, conv_dim, K-1]`` (HF's ``[C, K-1]`` per sequence) or
``[L, S, K-1, conv_dim]``: for those the TPU compiler picks the parameter's physical layout itself
(``[slot][tap][layer][channel]``, seen in deviceless compiles for Ironwood) and then relays the whole pool
out and back in every decode step to gather one layer's rows (0.3 GiB per step at 64 requests, 1.2 GiB x 2 at
512, per device).

:func:`gather_windows` / :func:`scatter_windows` are XLA's gather and scatter of a batch's windows (the
reference path). ``fused_gdn`` moves the same windows by one DMA per row (kernels/gdn/window_copy.py: a slot's
K-1 rows are one contiguous block here, and XLA's scatter of them ran at ~170 GB/s on the v5e).

One sequence's state travels (host snapshots, PD transfer) as ``[n_gdn_layers, conv_dim, K-1]``, HF's
orientation: :func:`read_slot` / :func:`write_slot` turn it around.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

LANES = 128


def lanes_of(conv_dim: int) -> int:
    """Channels per row block: 128 when it divides ``conv_dim`` (every released layout), else ``conv_dim``."""
    return LANES if conv_dim % LANES == 0 else conv_dim


def pool_shape(num_layers: int, num_slots: int, conv_dim: int, taps: int) -> tuple[int, int, int, int]:
    """Shape of the pool for ``taps = K-1`` inputs of window per slot."""
    lanes = lanes_of(conv_dim)
    return (num_layers, num_slots * taps, conv_dim // lanes, lanes)


def conv_dim_of(conv_pool: jax.Array) -> int:
    """Channels of a pool (its last two axes together)."""
    return conv_pool.shape[2] * conv_pool.shape[3]


def taps_of(conv_pool: jax.Array, num_slots: int) -> int:
    """``K-1`` of a pool holding ``num_slots`` slots (ValueError if its rows do not split evenly)."""
    taps, rest = divmod(conv_pool.shape[1], num_slots)
    if rest or taps == 0:
        raise ValueError(f"conv pool {conv_pool.shape} does not hold {num_slots} slots")
    return taps


def slot_rows(slots: jax.Array, taps: int) -> jax.Array:
    """Row ids of ``slots [B]`` (int32): ``[B * taps]``, slot-major. Out-of-range slots give out-of-range
    rows, so a ``mode="drop"`` update drops them as it would the slots."""
    return (slots.astype(jnp.int32)[:, None] * taps + jnp.arange(taps, dtype=jnp.int32)).reshape(-1)


def gather_windows(conv_pool: jax.Array, layer: jax.Array | int, slots: jax.Array, taps: int) -> jax.Array:
    """The windows of ``slots [B]`` in GDN layer ``layer``: ``[B, K-1, conv_dim]`` (taps-major)."""
    return conv_pool[layer, slot_rows(slots, taps)].reshape(slots.shape[0], taps, conv_dim_of(conv_pool))


def scatter_windows(conv_pool: jax.Array, layer: jax.Array | int, slots: jax.Array, windows: jax.Array) -> jax.Array:
    """``conv_pool`` with layer ``layer``'s windows of ``slots [B]`` set to ``windows [B, K-1, conv_dim]``."""
    b, taps, _ = windows.shape
    rows = windows.reshape(b * taps, *conv_pool.shape[2:]).astype(conv_pool.dtype)
    return conv_pool.at[layer, slot_rows(slots, taps)].set(rows)


def read_slot(conv_pool: jax.Array, slot: int | jax.Array, taps: int) -> jax.Array:
    """One slot's windows, all layers, in the exchange orientation ``[n_gdn_layers, conv_dim, K-1]``."""
    rows = jax.lax.dynamic_slice_in_dim(conv_pool, jnp.asarray(slot, jnp.int32) * taps, taps, axis=1)
    return jnp.swapaxes(rows.reshape(conv_pool.shape[0], taps, conv_dim_of(conv_pool)), 1, 2)


def write_slot(conv_pool: jax.Array, slot: int | jax.Array, conv: jax.Array) -> jax.Array:
    """``conv_pool`` with one slot set from ``conv [n_gdn_layers, conv_dim, K-1]``; a slot past the pool
    is dropped (per-rank padding), as ``.at[].set(mode="drop")`` drops it."""
    layers, _, taps = conv.shape
    rows = slot_rows(jnp.reshape(jnp.asarray(slot, jnp.int32), (1,)), taps)
    windows = jnp.swapaxes(conv, 1, 2).reshape(layers, taps, *conv_pool.shape[2:])
    return conv_pool.at[:, rows].set(windows.astype(conv_pool.dtype), mode="drop")
