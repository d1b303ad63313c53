"""Put one parameter leaf on its devices, each device receiving only its own shard, read on demand.

The loader (model/weights.py) gives a ``read(g, experts)`` callback that returns host arrays for layer
row ``g`` of a stacked leaf (None: the leaf is not stacked) restricted to the experts ``experts`` (a
slice of the expert dim; None: all, or not an expert stack). Devices are grouped by the shard they hold
(replicas over the data axis share one read); per group the host holds one shard of one layer at a time:

- unstacked leaf: the shard is read once and ``device_put`` to each device of the group;
- stacked leaf ``[G, ...]``: each device gets a zero buffer of its shard's shape and row ``g`` is written
  into it in place (``dynamic_update_index_in_dim`` with the buffer donated), so neither the host nor a
  device ever holds a second copy of the stack.

The per-device buffers become one global array with ``jax.make_array_from_single_device_arrays``.
Only the expert dim (dim 0 unstacked, dim 1 stacked) may be split; parallel/sharding.py splits nothing else.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from sglang_tpu_qwen.parallel.fp8 import Fp8Weight

Reader = Callable[[int | None, slice | None], Any]  # -> np.ndarray, or (q, scale) for an Fp8Weight leaf


@partial(jax.jit, donate_argnums=0)
def _set_row(buf: jax.Array, row: jax.Array, g: jax.Array) -> jax.Array:
    return jax.lax.dynamic_update_index_in_dim(buf, row, g, 0)


def _groups(sharding: Any, shape: tuple[int, ...], split_dim: int) -> list[tuple[slice | None, list[Any]]]:
    """Devices of ``sharding`` grouped by the slice of ``split_dim`` they hold (None: the whole leaf)."""
    groups: dict[tuple[int, int] | None, list[Any]] = {}
    for dev, index in sharding.addressable_devices_indices_map(shape).items():
        key = None
        for d, sl in enumerate(index):
            start, stop, _ = sl.indices(shape[d])
            if (start, stop) == (0, shape[d]):
                continue
            if d != split_dim:
                raise NotImplementedError(f"the streaming load splits only dim {split_dim} of {shape}, not dim {d}")
            key = (start, stop)
        groups.setdefault(key, []).append(dev)
    return [(None if k is None else slice(*k), devs) for k, devs in groups.items()]


def _shard_shape(shape: tuple[int, ...], split_dim: int, part: slice | None) -> tuple[int, ...]:
    if part is None:
        return shape
    start, stop, _ = part.indices(shape[split_dim])
    return (*shape[:split_dim], stop - start, *shape[split_dim + 1 :])


def place(abstract: Any, sharding: Any, read: Reader, stacked: bool) -> Any:
    """The leaf ``abstract`` (ShapeDtypeStruct, or Fp8Weight of them) built on ``sharding`` (a Sharding,
    or an Fp8Weight of Shardings with q and scale split alike) from ``read``.

    Raises:
        NotImplementedError: the sharding splits a dim other than the expert dim.
    """
    fp8 = isinstance(abstract, Fp8Weight)
    parts = [(abstract.q, sharding.q), (abstract.scale, sharding.scale)] if fp8 else [(abstract, sharding)]
    split_dim = 1 if stacked else 0
    groups = _groups(parts[0][1], tuple(parts[0][0].shape), split_dim)
    bufs: list[dict[Any, jax.Array]] = [{} for _ in parts]
    for experts, devs in groups:
        if not stacked:
            host = read(None, experts)
            for k, arr in enumerate(host if fp8 else (host,)):
                bufs[k].update({d: jax.device_put(arr, d) for d in devs})
            del host  # one shard on the host at a time
            continue
        for k, (sds, _) in enumerate(parts):
            shard = _shard_shape(tuple(sds.shape), split_dim, experts)
            bufs[k].update({d: jnp.zeros(shard, sds.dtype, device=d) for d in devs})
        for g in range(parts[0][0].shape[0]):
            host = read(g, experts)
            for k, arr in enumerate(host if fp8 else (host,)):
                for d in devs:
                    bufs[k][d] = _set_row(bufs[k][d], jax.device_put(np.asarray(arr), d), jnp.int32(g))
            del host
    out = []
    for (sds, sh), by_dev in zip(parts, bufs, strict=True):
        shape = tuple(sds.shape)
        out.append(jax.make_array_from_single_device_arrays(
            shape, sh, [by_dev[d] for d in sh.addressable_devices_indices_map(shape)]))
    return Fp8Weight(q=out[0], scale=out[1], block=abstract.block) if fp8 else out[0]
