"""Device-side operations on GDN state slots: copy (snapshot <-> running), NaN-fill, host transfer.

The GDN state of one sequence is the conv window and the recurrent state of every GDN layer: the slot's
K-1 rows of cache["conv"] ([n_gdn_layers, slots * (K-1), conv_dim / 128, 128]; a host copy is
[n_gdn_layers, conv_dim, K-1]) and its slot of cache["rec"] ([n_gdn_layers, slots, Hv, dk, dv]; a host copy
[n_gdn_layers, Hv, dk, dv]). Where a slot lives in the pools is the GDN backend's `GdnStateLayout`'s to say
(kernels/gdn/state_layout.py): every function here takes it (default: the one layout there is). Running requests
and prefix-cache snapshots both live in these arrays; only the id pools that hand slots out tell them
apart. Each function here touches all GDN layers in one jitted scatter, with the cache donated so it is
updated in place.

With data-parallel attention the slot axis is split over the mesh's batch axes (parallel/sharding.py) and
callers pass global slot ids; a copy never crosses ranks (a rank's snapshots hold its own requests'
state), so each operation runs as a `shard_map` on rank-local ids and moves no data between devices
(a global-index scatter would make XLA insert collectives for what is a local copy).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from sglang_tpu_qwen.kernels.gdn.state_layout import GDN_STATE_LAYOUT, GdnStateLayout
from sglang_tpu_qwen.utils.shapes import next_pow2

GDN_KEYS = ("conv", "rec")


def _index(cache: dict, key: str, slots: jax.Array, layout: GdnStateLayout) -> jax.Array:
    """Indices along the slot axis of ``cache[key]`` for ``slots`` (``GdnStateLayout.slot_index``)."""
    return layout.slot_index(key, slots, layout.taps_of(cache["conv"], cache["rec"]))


def _at_slots(layout: GdnStateLayout, index: jax.Array) -> tuple[Any, ...]:
    """An index tuple selecting ``index`` along the layout's slot axis (every layer)."""
    return (slice(None),) * layout.slot_axis + (index,)


def _copy_body(cache: dict, src: jax.Array, dst: jax.Array, *, layout: GdnStateLayout) -> dict:
    out = dict(cache)
    for key in GDN_KEYS:  # out-of-range destinations (per-rank padding) are dropped
        got = cache[key][_at_slots(layout, _index(cache, key, src, layout))]
        out[key] = cache[key].at[_at_slots(layout, _index(cache, key, dst, layout))].set(got, mode="drop")
    return out


def _fill_nan_body(cache: dict, slots: jax.Array, *, layout: GdnStateLayout) -> dict:
    out = dict(cache)
    for key in GDN_KEYS:
        out[key] = cache[key].at[_at_slots(layout, _index(cache, key, slots, layout))].set(jnp.nan, mode="drop")
    return out


def _write_body(cache: dict, slot: jax.Array, conv: jax.Array, rec: jax.Array, *, layout: GdnStateLayout) -> dict:
    slot = slot.reshape(())  # a scalar, or this rank's one-element block of ids under shard_map
    out = dict(cache)
    out["conv"], out["rec"] = layout.write_slot(cache["conv"], cache["rec"], slot, conv, rec)
    return out


def _padded(pairs: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
    """Pad to a power of two with 0 -> 0 copies (slot 0 is the trash slot) to bound compilations.

    Host arrays: the jitted copy takes them with its call (an eager `jnp.asarray` per array cost more than
    the copy itself in the serving loop)."""
    n = next_pow2(len(pairs))
    src = np.zeros(n, np.int32)
    dst = np.zeros(n, np.int32)
    for i, (s, d) in enumerate(pairs):
        src[i], dst[i] = s, d
    return src, dst


@dataclass(frozen=True)
class _RankSplit:
    """How the slot axis of a sharded cache is split: `ranks` blocks of `per_rank` slots over `axes`."""

    mesh: Mesh
    axes: tuple[str, ...]
    ranks: int
    per_rank: int

    def local(self, slot: int) -> tuple[int, int]:
        """Global slot id -> (rank, local id)."""
        return divmod(slot, self.per_rank)


def _rank_split(cache: dict, layout: GdnStateLayout) -> _RankSplit | None:
    """The slot-axis split of `cache` when its GDN arrays are sharded over data-parallel ranks, else None."""
    sharding, axis = cache["conv"].sharding, layout.slot_axis
    if not isinstance(sharding, NamedSharding) or len(sharding.spec) <= axis or sharding.spec[axis] is None:
        return None
    axes = sharding.spec[axis] if isinstance(sharding.spec[axis], tuple) else (sharding.spec[axis],)
    ranks = math.prod(sharding.mesh.shape[a] for a in axes)
    if ranks == 1:
        return None
    return _RankSplit(sharding.mesh, axes, ranks, layout.num_slots(cache["rec"]) // ranks)


def _per_rank(split: _RankSplit, columns: list[list[int]], fill: int) -> list[np.ndarray]:
    """Per column, a rank-major [ranks * n] int32 array of local ids, rank r's entries padded with `fill` to
    n (a power of two). Each row's ids must all be on one rank (ValueError)."""
    per = [[[] for _ in range(split.ranks)] for _ in columns]
    for row in zip(*columns, strict=True):
        rank = split.local(row[0])[0]
        for col, slot in zip(per, row, strict=True):
            r, local = split.local(slot)
            if r != rank:
                raise ValueError(f"slot {slot} is not on data-parallel rank {rank}")
            col[rank].append(local)
    n = next_pow2(max(len(x) for x in per[0]))
    out = []
    for col in per:
        arr = np.full((split.ranks, n), fill, np.int32)
        for rank, ids in enumerate(col):
            arr[rank, : len(ids)] = ids
        out.append(arr.reshape(-1))
    return out


@partial(jax.jit, static_argnames=("body", "split", "num_ids", "layout"), donate_argnums=(0,))
def _run(cache: dict, *args: jax.Array, body: Any, split: _RankSplit | None, num_ids: int,
         layout: GdnStateLayout) -> dict:
    """`body(cache, *args, layout=layout)` on one device, or per DP rank under `shard_map` when `split` is set:
    then the first `num_ids` args are rank-major arrays of local ids (each rank gets its block) and the rest
    are replicated. Only the GDN pools are split by the state layout's slot axis; the cache holds them and the
    KV pools, whose pages sit on the same axis (kernels/ragged_paged_attention/layout.py)."""
    body = partial(body, layout=layout)
    if split is None:
        return body(cache, *args)
    cspec = {k: P(*([None] * layout.slot_axis), split.axes) for k in cache}
    specs = (cspec, *([P(split.axes)] * num_ids), *([P()] * (len(args) - num_ids)))
    return jax.shard_map(body, mesh=split.mesh, in_specs=specs, out_specs=cspec, check_vma=False)(cache, *args)


def copy_slots(cache: dict, pairs: list[tuple[int, int]], layout: GdnStateLayout = GDN_STATE_LAYOUT) -> dict:
    """Copy GDN state slot src -> dst for each (src, dst) pair, all GDN layers; returns the new cache.

    Destinations must be distinct and disjoint from sources (a snapshot and a running slot never alias).
    On a cache split over DP ranks both slots of a pair must be on the same rank (ValueError otherwise).
    """
    if not pairs:
        return cache
    split = _rank_split(cache, layout)
    if split is not None:
        src, dst = _per_rank(split, [[s for s, _ in pairs], [d for _, d in pairs]], split.per_rank)
        src = np.where(src == split.per_rank, 0, src)  # padding reads slot 0 and writes nowhere
        return _run(cache, src, dst, body=_copy_body, split=split, num_ids=2, layout=layout)
    src, dst = _padded(pairs)
    return _run(cache, src, dst, body=_copy_body, split=None, num_ids=2, layout=layout)


def fill_nan(cache: dict, slots: list[int], layout: GdnStateLayout = GDN_STATE_LAYOUT) -> dict:
    """Fill freed slots with NaN (--debug-nan-fill-freed-slots): a stale read then poisons the output."""
    if not slots:
        return cache
    split = _rank_split(cache, layout)
    if split is not None:
        (dst,) = _per_rank(split, [slots], split.per_rank)  # padding: out of range, dropped
        return _run(cache, dst, body=_fill_nan_body, split=split, num_ids=1, layout=layout)
    # Pad by repeating the first slot, not with the trash slot 0, which padded batch rows read.
    arr = np.full(next_pow2(len(slots)), slots[0], np.int32)
    arr[: len(slots)] = slots
    return _run(cache, arr, body=_fill_nan_body, split=None, num_ids=1, layout=layout)


@partial(jax.jit, static_argnames=("layout",))
def _read_body(conv: jax.Array, rec: jax.Array, slot: jax.Array, layout: GdnStateLayout) -> tuple[jax.Array, jax.Array]:
    """Fresh device copies of one slot's state (not aliasing the cache, which a later op may donate)."""
    return layout.read_slot(conv, rec, slot)


def read_slot_async(cache: dict, slot: int, layout: GdnStateLayout = GDN_STATE_LAYOUT) -> tuple[jax.Array, jax.Array]:
    """Device copies of one slot's state, (conv [n_gdn, conv_dim, K-1], rec [n_gdn, Hv, dk, dv]), with their
    copy to the host started; returns without waiting for the device (the host tier's demotion).

    The copies are taken in dispatch order, so the slot may be overwritten right after this returns. On a
    cache split over DP ranks they are read on the device holding the slot (no collective) and live there.
    `np.asarray` of a result waits for its transfer only.
    """
    if _rank_split(cache, layout) is None:
        conv, rec = _read_body(cache["conv"], cache["rec"], np.int32(slot), layout=layout)
    else:
        conv_shard, rec_shard, local = _local_shards(cache, slot, layout)
        conv, rec = _read_body(conv_shard, rec_shard, np.int32(local), layout=layout)
    conv.copy_to_host_async()
    rec.copy_to_host_async()
    return conv, rec


def read_slot(cache: dict, slot: int, layout: GdnStateLayout = GDN_STATE_LAYOUT) -> tuple[np.ndarray, np.ndarray]:
    """Host copies of one slot's state: (conv [n_gdn, conv_dim, K-1], rec [n_gdn, Hv, dk, dv]); blocks."""
    conv, rec = read_slot_async(cache, slot, layout)
    return np.asarray(conv), np.asarray(rec)


def _local_shards(cache: dict, slot: int, layout: GdnStateLayout) -> tuple[jax.Array, jax.Array, int]:
    """The conv and rec shards (one device's blocks) holding global slot ``slot``, and its index in them."""
    taps, axis = layout.taps_of(cache["conv"], cache["rec"]), layout.slot_axis
    for conv_shard in cache["conv"].addressable_shards:
        block = conv_shard.index[axis]
        start = block.start or 0
        stop = cache["conv"].shape[axis] if block.stop is None else block.stop
        if start <= slot * taps < stop:
            local = slot - start // taps
            rec_shard = next(s for s in cache["rec"].addressable_shards if s.device == conv_shard.device)
            return conv_shard.data, rec_shard.data, local
    raise ValueError(f"slot {slot} is not held by this process")


def write_slot(cache: dict, slot: int, conv: np.ndarray | jax.Array, rec: np.ndarray | jax.Array,
               layout: GdnStateLayout = GDN_STATE_LAYOUT) -> dict:
    """Upload a copy (host arrays from read_slot, or device arrays from read_slot_async) into a slot; returns
    the new cache. Dispatched without waiting: the upload overlaps the step the device is running."""
    split = _rank_split(cache, layout)
    if split is not None:
        rank, local = split.local(slot)
        ids = np.full(split.ranks, split.per_rank, np.int32)  # other ranks: out of range, dropped
        ids[rank] = local
        # Replicated over the mesh (a pending host-tier entry is a device array on its rank's device).
        conv, rec = jax.device_put([conv, rec], NamedSharding(split.mesh, P()))
        return _run(cache, jnp.asarray(ids), conv, rec, body=_write_body, split=split, num_ids=1, layout=layout)
    return _run(cache, jnp.asarray(slot, jnp.int32), jnp.asarray(conv), jnp.asarray(rec), body=_write_body,
                split=None, num_ids=1, layout=layout)
