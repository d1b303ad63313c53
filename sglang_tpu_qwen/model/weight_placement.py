"""Put one parameter leaf on its devices, each device receiving only its own shard, read on demand.

The loader (model/weights.py) gives a ``read(g, experts)`` callback that returns host arrays for layer
row ``g`` of a stacked leaf (None: the leaf is not stacked) restricted to the experts ``experts`` (a
slice of the expert dim; None: all, or not an expert stack). Devices are grouped by the shard they hold
(replicas over the data axis share one read); per group the host holds one shard of one layer at a time:

- unstacked leaf: the shard is read once and ``device_put`` to each device of the group;
- stacked leaf ``[G, ...]`` up to HOST_STACK_BYTES: the rows are stacked on the host, then as above;
- larger stacked leaf: the global buffer is created as zeros in its sharding and each row ``g`` (a
  global array of the row's shards) is written into it in place (``dynamic_update_index_in_dim`` with the
  buffer donated: one compiled program per leaf kind, not per device), so neither the host nor a device
  ever holds a second copy of the stack.

The per-device buffers become one global array with ``jax.make_array_from_single_device_arrays``.
Only the expert dim (dim 0 unstacked, dim 1 stacked) may be split; parallel/sharding.py splits nothing else.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from sglang_tpu_qwen.quant.fp8 import Fp8Weight

# A stacked leaf up to this size (all rows, q + scale) is stacked on the host and sent once; larger ones
# are written row by row into their device buffers (no compiled update program for small leaves).
HOST_STACK_BYTES = 64 << 20
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


def _row_sharding(sharding: Any) -> Any:
    """Sharding of one row ``[...]`` of a stacked leaf ``[G, ...]`` (dim 0 is never split)."""
    if isinstance(sharding, NamedSharding):
        return NamedSharding(sharding.mesh, P(*tuple(sharding.spec)[1:]))
    return sharding


def _assemble(shape: tuple[int, ...], sharding: Any, by_dev: dict[Any, jax.Array]) -> jax.Array:
    return jax.make_array_from_single_device_arrays(
        shape, sharding, [by_dev[d] for d in sharding.addressable_devices_indices_map(shape)])


def place(abstract: Any, sharding: Any, read: Reader, stacked: bool) -> Any:
    """The leaf ``abstract`` (ShapeDtypeStruct, or Fp8Weight of them) built on ``sharding`` (a Sharding,
    or an Fp8Weight of Shardings with q and scale split alike) from ``read``.

    Raises:
        NotImplementedError: the sharding splits a dim other than the expert dim.
    """
    fp8 = isinstance(abstract, Fp8Weight)
    parts = [(abstract.q, sharding.q), (abstract.scale, sharding.scale)] if fp8 else [(abstract, sharding)]
    leaf_bytes = sum(math.prod(sds.shape) * np.dtype(sds.dtype).itemsize for sds, _ in parts)
    if stacked and leaf_bytes > HOST_STACK_BYTES:  # rows written into the global buffer in place
        rows = [(tuple(sds.shape[1:]), _row_sharding(sh)) for sds, sh in parts]
        bufs = [jnp.zeros(tuple(sds.shape), sds.dtype, device=sh) for sds, sh in parts]
        for g in range(parts[0][0].shape[0]):
            row_bufs = _read_shards(rows, read, g, fp8)
            bufs = [_set_row(buf, _assemble(shape, sh, rb), jnp.int32(g))
                    for buf, (shape, sh), rb in zip(bufs, rows, row_bufs, strict=True)]
        out = bufs
    else:  # unstacked, or a small stack (G rows of norms, biases, small projections) stacked on the host
        shapes = [(tuple(sds.shape), sh) for sds, sh in parts]
        if stacked:
            g_rows = parts[0][0].shape[0]

            def read_all(_: int | None, experts: slice | None) -> Any:
                rows = [read(g, experts) for g in range(g_rows)]
                return tuple(np.stack(r) for r in zip(*rows, strict=True)) if fp8 else np.stack(rows)

            reader: Reader = read_all
            split_dim = 1
        else:
            reader, split_dim = read, 0
        out = [_assemble(shape, sh, rb) for (shape, sh), rb in
               zip(shapes, _read_shards(shapes, reader, None, fp8, split_dim), strict=True)]
    return Fp8Weight(q=out[0], scale=out[1], block=abstract.block) if fp8 else out[0]


def _read_shards(parts: list[tuple[tuple[int, ...], Any]], read: Reader, g: int | None, fp8: bool,
                 split_dim: int = 0) -> list[dict[Any, jax.Array]]:
    """Per part (q, scale or the dense array) the device buffers of row ``g`` (None: the whole leaf), each
    distinct shard read once from ``read`` and ``device_put`` to the devices that hold it."""
    shape, sh = parts[0]
    bufs: list[dict[Any, jax.Array]] = [{} for _ in parts]
    for experts, devs in _groups(sh, shape, split_dim):
        host = read(g, experts)
        for k, arr in enumerate(host if fp8 else (host,)):
            bufs[k].update({d: jax.device_put(np.asarray(arr), d) for d in devs})
        del host  # one shard of one row on the host at a time
    return bufs
