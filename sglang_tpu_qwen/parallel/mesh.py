"""The device mesh: named axes ``data`` x ``expert`` x ``tensor`` and which of them each part of the model uses.

Layouts (docs/internals.md, "parallel/"):

- ``dp % ep == 0`` (e.g. the Ironwood host, dp8 and ep8 over 8 devices): mesh ``(dp // ep, ep, tp)``;
  attention is data-parallel over ``data`` *and* ``expert`` (each device its own requests, KV pages and
  GDN slots); experts are split over ``expert``.
- otherwise (e.g. dp1-ep8, dp2-ep4): mesh ``(dp, ep, tp)``; attention is data-parallel over ``data`` and
  replicated over ``expert``; experts are split over ``expert``.

Device order puts the two TensorCores of a chip next to each other on the ``expert`` axis (the core index
varies fastest, then chip x, y, z), so bit 0 of an expert-axis index selects the core within a chip and
the higher bits select the chip: the hierarchical combine (collectives.py) relies on that.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

DATA = "data"
EXPERT = "expert"
TENSOR = "tensor"
AXES = (DATA, EXPERT, TENSOR)


def device_sort_key(d: Any) -> tuple[int, ...]:
    """Order key: process, chip coordinates (z, y, x), core on chip, id. Devices without coordinates
    (CPU, GPU) sort by process and id."""
    coords = getattr(d, "coords", None)
    core = getattr(d, "core_on_chip", 0)
    if coords is None:
        return (d.process_index, 0, 0, 0, 0, d.id)
    x, y, z = (list(coords) + [0, 0, 0])[:3]
    return (d.process_index, z, y, x, core, d.id)


def make_mesh(dp: int, ep: int, tp: int = 1, devices: Sequence[Any] | None = None) -> Mesh:
    """A ``jax.sharding.Mesh`` with axes ``("data", "expert", "tensor")`` for the given sizes.

    Args:
        dp: attention data-parallel size (see the module docstring for how it shapes the mesh).
        ep: expert-parallel size; must divide the number of experts (checked by the MoE).
        tp: tensor-parallel size; only 1 is implemented.
        devices: devices to use (default ``jax.devices()``, which spans every process after
            ``jax.distributed.initialize``); the first ``mesh size`` of them, ordered by
            :func:`device_sort_key`, are used.

    Raises:
        ValueError: a size < 1, ``tp != 1``, or fewer devices than the mesh needs.
    """
    if min(dp, ep, tp) < 1:
        raise ValueError(f"parallel sizes must be >= 1, got dp={dp} ep={ep} tp={tp}")
    if tp != 1:
        raise ValueError("tensor parallelism is not implemented (use --tp-size 1 with --dp-size/--ep-size)")
    data = dp // ep if dp % ep == 0 else dp
    size = data * ep * tp
    devs = list(jax.devices() if devices is None else devices)
    if len(devs) < size:
        raise ValueError(f"dp={dp} ep={ep} tp={tp} needs {size} devices, {len(devs)} available")
    devs = sorted(devs, key=device_sort_key)[:size]
    return Mesh(np.array(devs, dtype=object).reshape(data, ep, tp), AXES)


@dataclasses.dataclass(frozen=True)
class Layout:
    """A mesh plus the roles of its axes.

    Attributes:
        mesh: from :func:`make_mesh`.
        dp: attention data-parallel ranks (= product of ``batch_axes`` sizes).
        ep: expert-parallel ranks (= size of ``expert``).
        batch_axes: mesh axes that split requests, KV pages and GDN slots.
    """

    mesh: Mesh
    dp: int
    ep: int
    batch_axes: tuple[str, ...]

    @property
    def attention_spans_experts(self) -> bool:
        """True when each expert-axis device has its own tokens (DP attention over the expert axis)."""
        return EXPERT in self.batch_axes


def make_layout(dp: int, ep: int, tp: int = 1, devices: Sequence[Any] | None = None) -> Layout:
    """:func:`make_mesh` plus axis roles (see the module docstring). Raises as :func:`make_mesh`."""
    mesh = make_mesh(dp, ep, tp, devices)
    batch_axes = (DATA, EXPERT) if dp % ep == 0 else (DATA,)
    return Layout(mesh=mesh, dp=dp, ep=ep, batch_axes=batch_axes)
