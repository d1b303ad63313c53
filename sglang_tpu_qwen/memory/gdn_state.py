"""Device-side operations on GDN state slots: copy (snapshot <-> running), NaN-fill, host transfer.

The GDN state of one sequence is the conv window and the recurrent state of every GDN layer:
cache["conv"][:, slot] ([n_gdn_layers, conv_dim, K-1]) and cache["rec"][:, slot]
([n_gdn_layers, Hv, dk, dv]). Running requests and prefix-cache snapshots both live in these arrays;
only the id pools that hand slots out tell them apart. Each function here touches all GDN layers in
one jitted scatter, with the cache donated so it is updated in place.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from sglang_tpu_qwen.engine.model_runner import next_pow2

GDN_KEYS = ("conv", "rec")


@partial(jax.jit, donate_argnums=(0,))
def _copy_slots(cache: dict, src: jax.Array, dst: jax.Array) -> dict:
    out = dict(cache)
    for key in GDN_KEYS:
        out[key] = cache[key].at[:, dst].set(cache[key][:, src])
    return out


@partial(jax.jit, donate_argnums=(0,))
def _fill_nan(cache: dict, slots: jax.Array) -> dict:
    out = dict(cache)
    for key in GDN_KEYS:
        out[key] = cache[key].at[:, slots].set(jnp.nan)
    return out


@partial(jax.jit, donate_argnums=(0,))
def _write_slot(cache: dict, slot: jax.Array, conv: jax.Array, rec: jax.Array) -> dict:
    out = dict(cache)
    out["conv"] = cache["conv"].at[:, slot].set(conv)
    out["rec"] = cache["rec"].at[:, slot].set(rec)
    return out


def _padded(pairs: list[tuple[int, int]]) -> tuple[jax.Array, jax.Array]:
    """Pad to a power of two with 0 -> 0 copies (slot 0 is the trash slot) to bound compilations."""
    n = next_pow2(len(pairs))
    src = np.zeros(n, np.int32)
    dst = np.zeros(n, np.int32)
    for i, (s, d) in enumerate(pairs):
        src[i], dst[i] = s, d
    return jnp.asarray(src), jnp.asarray(dst)


def copy_slots(cache: dict, pairs: list[tuple[int, int]]) -> dict:
    """Copy GDN state slot src -> dst for each (src, dst) pair, all GDN layers; returns the new cache.

    Destinations must be distinct and disjoint from sources (a snapshot and a running slot never alias).
    """
    if not pairs:
        return cache
    src, dst = _padded(pairs)
    return _copy_slots(cache, src, dst)


def fill_nan(cache: dict, slots: list[int]) -> dict:
    """Fill freed slots with NaN (--debug-nan-fill-freed-slots): a stale read then poisons the output."""
    if not slots:
        return cache
    # Pad by repeating the first slot, not with the trash slot 0, which padded batch rows read.
    arr = np.full(next_pow2(len(slots)), slots[0], np.int32)
    arr[: len(slots)] = slots
    return _fill_nan(cache, jnp.asarray(arr))


def read_slot(cache: dict, slot: int) -> tuple[np.ndarray, np.ndarray]:
    """Host copies of one slot's state: (conv [n_gdn, conv_dim, K-1], rec [n_gdn, Hv, dk, dv])."""
    return np.asarray(cache["conv"][:, slot]), np.asarray(cache["rec"][:, slot])


def write_slot(cache: dict, slot: int, conv: np.ndarray, rec: np.ndarray) -> dict:
    """Upload a host copy (from read_slot) into a slot; returns the new cache."""
    return _write_slot(cache, jnp.asarray(slot, jnp.int32), jnp.asarray(conv), jnp.asarray(rec))
