"""How the GDN state pools are stored: the one place that knows the axes of ``cache["conv"]`` / ``cache["rec"]``.

``conv``: ``[n_gdn_layers, num_slots * (K-1), conv_dim / 128, 128]``, slot ``s`` owning ``K-1`` consecutive
rows (conv_pool.py says why this form). ``rec``: ``[n_gdn_layers, num_slots, Hv, dk, dv]``. Both hold every
GDN layer's state of every slot; slots are on axis 1 of both (the axis DP attention splits, each rank owning
a block of slots). One slot's state travels (host tier, PD transfer) as ``conv [n_gdn_layers, conv_dim, K-1]``
(HF's orientation) and ``rec [n_gdn_layers, Hv, dk, dv]``.

The GDN backend (kernels/gdn_backend.py) carries the layout; ``init_cache``, memory/gdn_state.py,
memory/kv_io.py, disagg/layout.py, the prefix cache's host tier and the sharding ask it instead of indexing
pool shapes by position. A frozen dataclass with no array state: static configuration, hashable.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from sglang_tpu_qwen.kernels.gdn import conv_pool


@dataclass(frozen=True)
class GdnStateLayout:
    """The conv and recurrent state pools' stored shapes and per-slot operations (module docstring)."""

    name: ClassVar[str] = "slot_rows"
    slot_axis: ClassVar[int] = 1  # of both pools: conv rows (K-1 per slot) and rec slots

    def conv_shape(self, layers: int, num_slots: int, conv_dim: int, taps: int) -> tuple[int, ...]:
        """Stored conv pool shape for ``taps = K-1`` inputs of window per slot."""
        return conv_pool.pool_shape(layers, num_slots, conv_dim, taps)

    def rec_shape(self, layers: int, num_slots: int, hv: int, dk: int, dv: int) -> tuple[int, ...]:
        """Stored recurrent state pool shape."""
        return layers, num_slots, hv, dk, dv

    def num_slots(self, rec: Any) -> int:
        """Slots of the pools (``rec`` an array or ShapeDtypeStruct)."""
        return rec.shape[self.slot_axis]

    def taps_of(self, conv: Any, rec: Any) -> int:
        """``K-1`` of the pools. Raises ValueError when the conv rows do not split into the rec pool's slots."""
        return conv_pool.taps_of(conv, self.num_slots(rec))

    def slot_index(self, key: str, slots: jax.Array, taps: int) -> jax.Array:
        """Indices along the slot axis of pool ``key`` (``"conv"`` or ``"rec"``) for ``slots [B]`` int32: the
        conv pool's ``K-1`` rows per slot (slot-major), or the slots themselves. Out-of-range slots give
        out-of-range indices, so a ``mode="drop"`` update drops them."""
        return conv_pool.slot_rows(slots, taps) if key == "conv" else slots

    def read_slot(self, conv: jax.Array, rec: jax.Array, slot: int | jax.Array) -> tuple[jax.Array, jax.Array]:
        """One slot's state, every layer: ``(conv [L, conv_dim, K-1], rec [L, Hv, dk, dv])`` in the pool dtype."""
        taps = self.taps_of(conv, rec)
        return (conv_pool.read_slot(conv, slot, taps),
                jax.lax.dynamic_index_in_dim(rec, jnp.asarray(slot, jnp.int32), axis=self.slot_axis, keepdims=False))

    def write_slot(self, conv: jax.Array, rec: jax.Array, slot: int | jax.Array, conv_state: jax.Array,
                   rec_state: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The pools with one slot set from a state shaped as :meth:`read_slot` returns it (cast to the pool
        dtypes); a slot past the pools (per-rank padding) is dropped."""
        return (conv_pool.write_slot(conv, slot, conv_state),
                rec.at[:, slot].set(rec_state.astype(rec.dtype), mode="drop"))

    def slot_shapes(self, conv: Any, rec: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Shapes of one slot's state as it travels: ``((L, conv_dim, K-1), (L, Hv, dk, dv))``."""
        return ((conv.shape[0], conv_pool.conv_dim_of(conv), self.taps_of(conv, rec)),
                (rec.shape[0], *rec.shape[self.slot_axis + 1:]))

    def slot_bytes(self, conv: Any, rec: Any) -> int:
        """Bytes of one slot's state, every layer, both pools."""
        return sum(int(np.prod(s)) * jnp.dtype(a.dtype).itemsize
                   for s, a in zip(self.slot_shapes(conv, rec), (conv, rec), strict=True))


GDN_STATE_LAYOUT = GdnStateLayout()
