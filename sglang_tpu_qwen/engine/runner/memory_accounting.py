"""Device memory accounting, as SGLang does it: the weights first, then the GDN state slots and the KV pool
share what is left of ``--mem-fraction-static`` (engine/runner/memory_split.py has the rule);
``/get_server_info`` reports the result per device.

Bytes come from the arrays actually built (per-device shard sizes from ``addressable_shards``) and from
the pools' layouts (``KVPoolLayout.page_bytes``, ``GdnStateLayout.slot_bytes``: nothing allocated), so an
FP8 weight, a bf16 KV cache or a float32 GDN state is counted at its own size.
SGLang's equivalents: ``ModelRunner.profile_max_num_token`` (pool size from the memory left after the
weights, hybrid-GDN models first reserving their mamba/state pool) and the scheduler's
``memory_usage`` (``weight`` and ``kvcache`` in GB = 2**30 bytes, ``token_capacity``).
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from typing import Any

import jax

from sglang_tpu_qwen.engine.runner.memory_split import GB
from sglang_tpu_qwen.kernels.gdn.state_layout import GDN_STATE_LAYOUT, GdnStateLayout
from sglang_tpu_qwen.kernels.ragged_paged_attention.layout import KVPoolLayout
from sglang_tpu_qwen.kernels.ragged_paged_attention.token_major import TOKEN_MAJOR
from sglang_tpu_qwen.model.config import Qwen35MoeConfig

_KV_KEYS = ("k", "v")
_STATE_KEYS = ("conv", "rec")


@dataclasses.dataclass(frozen=True)
class CacheUnits:
    """Bytes of one KV page (K and V of every attention layer) and of one GDN slot (conv + recurrent
    state of every GDN layer), at the cache dtypes in use."""

    kv_per_page: int
    gdn_per_slot: int
    page_size: int

    @property
    def kv_per_token(self) -> int:
        return self.kv_per_page // self.page_size


def cache_units(config: Qwen35MoeConfig, page_size: int, kv_dtype: Any, state_dtype: Any, mtp_layers: int = 0, *,
                kv_layout: KVPoolLayout = TOKEN_MAJOR, state_layout: GdnStateLayout = GDN_STATE_LAYOUT) -> CacheUnits:
    """Per-page and per-slot bytes of ``init_cache(config, ..., kv_dtype, state_dtype, mtp_layers)`` in these
    layouts (``mtp_layers``: the MTP layer's KV in every page, speculative decoding).

    Raises:
        ValueError: ``page_size`` does not fit ``kv_layout`` for ``kv_dtype`` (``KVPoolLayout.pool_shape``).
    """
    kv_layers = config.num_attn_layers + mtp_layers
    nkv, hd = config.num_key_value_heads, config.head_dim
    kv_layout.pool_shape(kv_layers, 1, page_size, nkv, hd, kv_dtype)  # the layout's page-size check
    kv = 2 * kv_layers * kv_layout.page_bytes(page_size, nkv, hd, kv_dtype)  # K and V
    taps = config.linear_conv_kernel_dim - 1
    conv = jax.ShapeDtypeStruct(state_layout.conv_shape(config.num_gdn_layers, 1, config.gdn_conv_dim, taps),
                                state_dtype)
    rec = jax.ShapeDtypeStruct(state_layout.rec_shape(config.num_gdn_layers, 1, config.linear_num_value_heads,
                                                      config.linear_key_head_dim, config.linear_value_head_dim),
                               state_dtype)
    return CacheUnits(kv, state_layout.slot_bytes(conv, rec), page_size)


def bytes_per_device(tree: Any) -> dict[Any, int]:
    """Device -> bytes of the shards of ``tree``'s arrays that live on it. ShapeDtypeStructs (the planner's
    abstract weights) count the shard their sharding gives each of its devices."""
    out: dict[Any, int] = defaultdict(int)
    for leaf in jax.tree.leaves(tree):
        if isinstance(leaf, jax.ShapeDtypeStruct):
            shard = math.prod(leaf.sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize
            for device in leaf.sharding.device_set:
                out[device] += shard
            continue
        for shard in leaf.addressable_shards:
            out[shard.device] += shard.data.nbytes
    return dict(out)


def device_memory_limit(device: Any) -> int | None:
    """Bytes of memory the runtime lets ``device`` use (its ``bytes_limit``); None where it reports none (CPU, or
    a deviceless topology's device, whose memory_stats raises)."""
    try:
        stats = device.memory_stats()
    except jax.errors.JaxRuntimeError:
        return None
    return (stats or {}).get("bytes_limit")


def memory_usage(params: Any, cache: Any, token_capacity: int, vision_bytes: int = 0) -> list[dict[str, Any]]:
    """Per device (SGLang's ``memory_usage`` of ``/get_server_info``, one entry per device):
    ``{"device", "weight", "kvcache", "gdn_state", "vision_encoder" (GB), "weight_bytes", "token_capacity" (KV
    tokens of the rank), "kv_cache_dtype" (the pages' dtype name, e.g. "float8_e4m3fn")}``. ``vision_bytes``:
    the vision encoder's ``memory_bytes()`` (replicated: the same on every device; 0 without one)."""
    weights = bytes_per_device(params)
    kv = bytes_per_device({k: cache[k] for k in _KV_KEYS})
    state = bytes_per_device({k: cache[k] for k in _STATE_KEYS})
    devices = sorted(set(weights) | set(kv), key=lambda d: (d.process_index, d.id))
    return [{
        "device": str(d),
        "weight": round(weights.get(d, 0) / GB, 6),
        "weight_bytes": int(weights.get(d, 0)),
        "kvcache": round(kv.get(d, 0) / GB, 6),
        "gdn_state": round(state.get(d, 0) / GB, 6),
        "vision_encoder": round(vision_bytes / GB, 6),
        "token_capacity": int(token_capacity),
        "kv_cache_dtype": cache["k"].dtype.name,
    } for d in devices]
