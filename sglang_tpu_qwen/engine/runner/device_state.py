"""Where the runner's arrays live (`Placement`) and the one owner of its mutable device buffers (`DeviceState`).

`Placement` answers "which sharding does this array take": the mesh of --dp-size / --ep-size (rows split over
the DP ranks, experts over the expert axis, the rest replicated) or one device. `DeviceState` holds the KV
pages and GDN slots (`cache`) and the sampled ids kept on the device for the next step (overlap scheduling);
every operation that replaces the cache besides the forward program goes through it: GDN slot copies, NaN
fill, slot reads / writes (host snapshot tier), KV gathers and writes (PD transfer). Ids crossing it are
global; `to_rank_local` turns a step's page / slot ids into the ids each DP rank's shard uses.
An abstract state (the deviceless planner) holds ShapeDtypeStructs with their shardings and allocates nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from sglang_tpu_qwen.args.server_args import ServerArgs
from sglang_tpu_qwen.engine.runner.sizing import RunnerSizing
from sglang_tpu_qwen.kernels.dispatch import KernelBackends
from sglang_tpu_qwen.memory import gdn_state, kv_io
from sglang_tpu_qwen.model.config import Qwen35MoeConfig
from sglang_tpu_qwen.model.forward import init_cache
from sglang_tpu_qwen.parallel.mesh import Layout, make_layout
from sglang_tpu_qwen.parallel.sharding import batch_pspec, cache_pspecs, param_pspecs, shardings
from sglang_tpu_qwen.utils.shapes import next_pow2


def abstract(tree: Any) -> Any:
    """ShapeDtypeStructs (with shardings where the leaves have one) of arrays or ShapeDtypeStructs."""
    def one(x: Any) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))

    return jax.tree.map(one, tree)


@dataclass(frozen=True)
class Placement:
    """The mesh (`layout`, when --dp-size x --ep-size > 1) or the single device the runner's arrays live on,
    and the JAX platform its programs are compiled for ("cpu", "tpu", "gpu": kernel choice, dtype default).

    device: without a mesh, the device an explicit device list pinned the runner to; None: the default device.
    """

    layout: Layout | None
    device: Any | None
    platform: str

    @classmethod
    def for_devices(cls, args: ServerArgs, devices: list[Any] | None = None,
                    platform: str | None = None) -> Placement:
        """The server's choice for `devices` (default: all of them): a mesh when --dp-size x --ep-size > 1
        (parallel/mesh.py; raises as make_layout), else the first given device (committed arrays: every
        program then runs there). `platform` defaults to `jax.default_backend()`."""
        layout = make_layout(args.dp_size, args.ep_size, args.tp_size, devices=devices) \
            if args.dp_size * args.ep_size > 1 else None
        device = devices[0] if devices and layout is None else None
        return cls(layout, device, platform or jax.default_backend())

    def single(self) -> SingleDeviceSharding:
        """The one device without a mesh (the pinned device, else the default one)."""
        return SingleDeviceSharding(self.device if self.device is not None else jax.devices()[0])

    def replicated(self) -> jax.sharding.Sharding:
        """Every device holds the whole array."""
        return self.single() if self.layout is None else NamedSharding(self.layout.mesh, P())

    def rows(self, ndim: int = 1) -> jax.sharding.Sharding:
        """A [B, ...] per-row array: rows split over the DP ranks (or the one device)."""
        if self.layout is None:
            return self.single()
        spec = batch_pspec(self.layout)
        return NamedSharding(self.layout.mesh, P(*spec, *([None] * (ndim - len(spec)))))

    def spec(self, shape: tuple[int, ...], dtype: Any, replicated: bool = False) -> jax.ShapeDtypeStruct:
        """An abstract argument as the programs take it (rows split, or replicated)."""
        return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype),
                                    sharding=self.replicated() if replicated else self.rows(len(shape)))

    def put(self, arrays: list[np.ndarray], replicated: bool = False) -> list[jax.Array | np.ndarray]:
        """Host arrays as the compiled programs take them: on one device the arrays themselves (the compiled
        call transfers them in C++; `jax.device_put` cost ~0.2 ms of Python per array, ~4 ms of host time per
        128-row step), with a mesh device arrays with the programs' shardings (one transfer call)."""
        if self.layout is None:
            return [np.asarray(a) for a in arrays]
        return jax.device_put(arrays, [self.replicated() if replicated else self.rows(np.ndim(a)) for a in arrays])

    def param_shardings(self, params: Any) -> Any:
        """Shardings of a parameter pytree (arrays or ShapeDtypeStructs): experts split over the expert axis,
        the rest replicated (parallel/sharding.py); the one device without a mesh."""
        if self.layout is None:
            target = self.single()
            return jax.tree.map(lambda _: target, params)
        return shardings(param_pspecs(params, self.layout), self.layout)

    def cache_shardings(self, backends: KernelBackends | None = None) -> Any:
        """Shardings of the cache dict (pages / slots split over the DP ranks, on the axes the backends' pool
        layouts name; None: the default layouts), or the one device's."""
        if self.layout is None:
            return self.single()
        backends = backends or KernelBackends()
        return shardings(cache_pspecs(self.layout, backends.attention.layout, backends.gdn.state_layout),
                         self.layout)


class DeviceState:
    """The KV pages and GDN slots of every DP rank (`cache`) and the kept sampled ids, with their operations.

    cache: {"k", "v": logically [L_attn, dp * num_pages, page_size, kv_heads, head_dim], stored in
    `kv_layout` (the attention backend's), KV dtype (--kv-cache-dtype: the compute dtype, bfloat16 or
    float8_e4m3fn); "conv", "rec": GDN state of dp * num_slots slots in `state_layout`, sizing.state_dtype
    (--mamba-ssm-dtype)} (model/forward.py `init_cache`), split over the DP ranks.
    """

    def __init__(self, config: Qwen35MoeConfig, sizing: RunnerSizing, placement: Placement, kv_dtype: Any,
                 abstract_only: bool = False, backends: KernelBackends | None = None) -> None:
        """Allocate the cache as zeros in its sharding (no device ever holds the global cache), committed like
        the caches the compiled steps return, so eager slot copies see one signature. `abstract_only`: the
        planner's state, ShapeDtypeStructs with shardings; nothing is allocated. `backends`: whose pool
        layouts the cache is stored in (None: the defaults)."""
        self.sizing, self.placement = sizing, placement
        backends = backends or KernelBackends()
        self.kv_layout, self.state_layout = backends.attention.layout, backends.gdn.state_layout
        self.num_kv_heads = config.num_key_value_heads
        make_cache = partial(init_cache, config, sizing.dp * sizing.num_pages, sizing.page_size,
                             sizing.dp * sizing.num_slots, kv_dtype, sizing.state_dtype, sizing.mtp_layers,
                             kv_layout=self.kv_layout, state_layout=self.state_layout)
        target = placement.cache_shardings(backends)
        if abstract_only:
            shapes = jax.eval_shape(make_cache)
            self.cache: Any = {k: jax.ShapeDtypeStruct(v.shape, v.dtype,
                                                       sharding=target[k] if isinstance(target, dict) else target)
                               for k, v in shapes.items()}
        else:
            self.cache = jax.jit(make_cache, out_shardings=target)()
        self.prev_tokens: jax.Array | None = None  # set by keep_sampled; zeros on first use
        self.spec_carry: jax.Array | None = None  # speculative decoding's carry (spec_programs._next_carry)

    def kept_tokens(self, rows: int) -> jax.Array:
        """The sampled ids [rows] int32 the last `keep_sampled` left on the device (zeros before any)."""
        if self.prev_tokens is None:
            self.prev_tokens = jax.device_put(np.zeros(rows, np.int32), self.placement.replicated())
        return self.prev_tokens

    def kept_carry(self, shape: tuple[int, int]) -> jax.Array:
        """The carry [R, T + 3] int32 the last verify step left on the device (zeros before any)."""
        if self.spec_carry is None:
            self.spec_carry = jax.device_put(np.zeros(shape, np.int32), self.placement.replicated())
        return self.spec_carry

    def to_rank_local(self, ids: np.ndarray, per_rank: int) -> np.ndarray:
        """Global page/slot ids [B, ...] -> the ids each rank's shard uses (row block r minus r * per_rank).

        Rank r owns rows [r*B/dp, (r+1)*B/dp); 0 (padding: the trash target) stays 0. Raises AssertionError
        when a row holds another rank's id.
        """
        dp = self.sizing.dp
        if dp == 1:
            return ids
        b = ids.shape[0]
        base = (np.arange(b) // (b // dp)) * per_rank
        base = base.reshape((b,) + (1,) * (ids.ndim - 1))
        local = np.where(ids > 0, ids - base, 0).astype(np.int32)
        if np.any(local < 0) or np.any(local >= per_rank):
            raise AssertionError("a row uses a page or slot of another DP rank")
        return local

    # ---- GDN slots and KV pages (global ids) --------------------------------------------------------
    def copy_slots(self, pairs: list[tuple[int, int]]) -> None:
        """Copy the GDN state of slot src into slot dst for each (src, dst) pair."""
        self.cache = gdn_state.copy_slots(self.cache, pairs, self.state_layout)

    def fill_nan_slots(self, slots: list[int]) -> None:
        """Poison freed GDN slots with NaN (--debug-nan-fill-freed-slots)."""
        self.cache = gdn_state.fill_nan(self.cache, slots, self.state_layout)

    def read_slot(self, slot: int) -> tuple[np.ndarray, np.ndarray]:
        """Host copy of one slot's GDN state (conv [n_gdn, conv_dim, K-1], rec [n_gdn, Hv, dk, dv])."""
        return gdn_state.read_slot(self.cache, slot, self.state_layout)

    def read_slot_async(self, slot: int) -> tuple[jax.Array, jax.Array]:
        """Device copies of one slot's GDN state with their host copy started, without waiting
        (gdn_state.read_slot_async: the host tier's demotion)."""
        return gdn_state.read_slot_async(self.cache, slot, self.state_layout)

    def write_slot(self, slot: int, conv: np.ndarray | jax.Array, rec: np.ndarray | jax.Array) -> None:
        """Upload a copy (from read_slot or read_slot_async) into a slot, without waiting."""
        self.cache = gdn_state.write_slot(self.cache, slot, conv, rec, self.state_layout)

    def gather_kv(self, pages: list[int], start: int, end: int) -> tuple[jax.Array, jax.Array]:
        """Token-major KV of positions [start, end) of a sequence with page table `pages` (kv_io.gather_kv)."""
        return kv_io.gather_kv(self.cache, self.kv_layout, self.num_kv_heads, pages, start, end)

    def read_gdn(self, slot: int) -> tuple[jax.Array, jax.Array]:
        """Device copies of one slot's GDN state (kv_io.read_gdn)."""
        return kv_io.read_gdn(self.cache, slot, self.state_layout)

    def write_state(self, pages: list[int], k: Any, v: Any, slot: int, conv: Any, rec: Any) -> None:
        """Write a transferred request's token-major KV into `pages` and its GDN state into `slot`."""
        self.cache = kv_io.write_kv(self.cache, self.kv_layout, pages, k, v)
        self.cache = kv_io.write_gdn(self.cache, slot, conv, rec, self.state_layout)

    def input_placement(self) -> jax.sharding.Sharding:
        """Where arrays given to write_state should live (replicated over the cache's devices)."""
        return kv_io.input_placement(self.cache)

    def precompile_slot_copies(self, max_rows: int, host_tier: bool) -> None:
        """The prefix cache copies GDN slots in groups padded to powers of two (memory/gdn_state.py): run each
        size up to next_pow2(max_rows) once on trash slot 0 (a copy onto itself) so its program exists
        before serving; with the host tier also a read and a write of each DP rank's trash slot (a read runs
        on the device holding the slot)."""
        # The copies are plain jit calls keyed on the cache's sharding, which may differ between a cache from
        # a step program and one from a copy (meshes): the caller runs a step program first; every size
        # twice, so both inputs are seen.
        sizes = [1 << i for i in range(next_pow2(max_rows).bit_length())]
        for n in sizes + sizes:
            self.cache = gdn_state.copy_slots(self.cache, [(0, 0)] * n, self.state_layout)
        if host_tier:  # demotion to host memory and restore from it: from host arrays and from pending device ones
            for rank in range(self.sizing.dp):
                trash = self.sizing.slot_base(rank)
                pending = gdn_state.read_slot_async(self.cache, trash, self.state_layout)
                self.cache = gdn_state.write_slot(self.cache, trash, *pending, self.state_layout)
                self.cache = gdn_state.write_slot(self.cache, trash, *(np.asarray(a) for a in pending),
                                                  self.state_layout)
