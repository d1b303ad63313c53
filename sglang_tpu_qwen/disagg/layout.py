"""StateLayout: what one request's transferred state looks like, so both sides can check they agree.

A prefill server and a decode server may differ in page size, pool sizes and mesh, but the state they
exchange must have the same model, dtypes and per-layer shapes. The layout is sent in the transfer's
header and compared field by field; a mismatch is an error naming both values, never a reinterpretation.
The exchanged state is logical (token-major KV, one slot's GDN state), not the pools' stored form, so the
two servers' pool layouts (kernels/ragged_paged_attention/layout.py, kernels/gdn/state_layout.py) may differ:
each side's layouts read and write its own pools (memory/kv_io.py) and are not part of the header.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from sglang_tpu_qwen.kernels.dispatch import KernelBackends
from sglang_tpu_qwen.model.config import Qwen35MoeConfig
from sglang_tpu_qwen.utils.errors import TransferError

PROTOCOL_VERSION = 1


@dataclass(frozen=True)
class StateLayout:
    """Dtypes and per-token / per-request shapes of the transferred state.

    KV chunks are token-major: k and v are each `[n_attn_layers, tokens, kv_heads, head_dim]` kv_dtype (the
    pages' dtype, --kv-cache-dtype: FP8 pages travel as their bytes, dequantised only by the attention).
    GDN state is `conv [n_gdn_layers, conv_dim, K - 1]` and `rec [n_gdn_layers, Hv, dk, dv]`, state_dtype.
    `fingerprint` hashes the model config, so two checkpoints of the same shape are told apart too.
    """

    fingerprint: str
    kv_dtype: str
    state_dtype: str
    kv_token_shape: tuple[int, int, int]  # (n_attn_layers, kv_heads, head_dim)
    conv_shape: tuple[int, int, int]  # (n_gdn_layers, conv_dim, K - 1)
    rec_shape: tuple[int, int, int, int]  # (n_gdn_layers, Hv, dk, dv)

    @classmethod
    def from_cache(cls, config: Qwen35MoeConfig, cache: dict[str, Any],
                   backends: KernelBackends | None = None) -> StateLayout:
        """The layout of an engine's device cache (`init_cache` arrays) for `config`, its pools stored as
        `backends`' layouts say (None: the defaults)."""
        backends = backends or KernelBackends()
        k, conv, rec = cache["k"], cache["conv"], cache["rec"]
        kv_layers, _, _, kv_heads, head_dim = backends.attention.layout.logical_shape(k, config.num_key_value_heads)
        conv_shape, rec_shape = backends.gdn.state_layout.slot_shapes(conv, rec)
        return cls(
            fingerprint=config_fingerprint(config),
            kv_dtype=np.dtype(k.dtype).name,
            state_dtype=np.dtype(conv.dtype).name,
            kv_token_shape=(kv_layers, kv_heads, head_dim),
            conv_shape=conv_shape,  # type: ignore[arg-type]
            rec_shape=rec_shape,  # type: ignore[arg-type]
        )

    def to_json(self) -> dict[str, Any]:
        return {f.name: list(v) if isinstance(v := getattr(self, f.name), tuple) else v
                for f in dataclasses.fields(self)}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> StateLayout:
        """Parse a header's layout; raises TransferError on a missing or malformed field."""
        try:
            return cls(fingerprint=str(d["fingerprint"]), kv_dtype=str(d["kv_dtype"]),
                       state_dtype=str(d["state_dtype"]),
                       kv_token_shape=tuple(int(x) for x in d["kv_token_shape"]),  # type: ignore[arg-type]
                       conv_shape=tuple(int(x) for x in d["conv_shape"]),  # type: ignore[arg-type]
                       rec_shape=tuple(int(x) for x in d["rec_shape"]))  # type: ignore[arg-type]
        except (KeyError, TypeError, ValueError) as e:
            raise TransferError(f"malformed state layout in the transfer header: {e!r}") from e

    def check_matches(self, sender: StateLayout) -> None:
        """Raise TransferError naming every field where the sender's layout differs from this (receiving) one."""
        diffs = [f"{f.name}: prefill {getattr(sender, f.name)} vs decode {getattr(self, f.name)}"
                 for f in dataclasses.fields(self) if getattr(sender, f.name) != getattr(self, f.name)]
        if diffs:
            raise TransferError("the prefill and decode servers' state layouts differ (" + "; ".join(diffs)
                                + "); serve the same model with the same --dtype, --kv-cache-dtype, "
                                  "--mamba-ssm-dtype and --speculative-algorithm on both (the MTP layer's KV "
                                  "is a layer of the pages)")


def config_fingerprint(config: Qwen35MoeConfig) -> str:
    """A short stable hash of the model config (every field, JSON-encoded with sorted keys)."""
    blob = json.dumps(dataclasses.asdict(config), sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def prompt_digest(token_ids: list[int]) -> str:
    """Hash of a prompt's token ids: both legs must have tokenized the request the same way."""
    return hashlib.sha256(np.asarray(token_ids, np.int64).tobytes()).hexdigest()[:16]
