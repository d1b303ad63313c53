"""The server's vision encoder: which one a checkpoint gets from the launch flags, and what it reports.

``build_vision_encoder`` reads --mm-embedding-cache-size-mb (else SGLang's ``SGLANG_VLM_CACHE_SIZE_MB``
environment variable, else the encoder's default) and --mm-max-patches, and places the tower on the runner's
mesh (or its one device). ModelRunner.from_checkpoint calls it; a text-only checkpoint gets None.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from sglang_tpu_qwen.args.server_args import ServerArgs
from sglang_tpu_qwen.engine.runner.device_state import Placement
from sglang_tpu_qwen.engine.runner.vision_encoder import DEFAULT_CACHE_BYTES, VisionEncoder

logger = logging.getLogger(__name__)

MIB = 1 << 20
# SGLang's knob for the same cache (MB, read from the environment; SGLang's default is 100).
SGLANG_CACHE_ENV = "SGLANG_VLM_CACHE_SIZE_MB"


def encoder_cache_bytes(args: ServerArgs) -> int:
    """Bytes of the encoder cache: --mm-embedding-cache-size-mb, else $SGLANG_VLM_CACHE_SIZE_MB, else
    DEFAULT_CACHE_BYTES (vision_encoder.py). Raises ValueError for a bad or negative environment value."""
    if args.mm_embedding_cache_size_mb is not None:
        return int(args.mm_embedding_cache_size_mb * MIB)
    env = os.environ.get(SGLANG_CACHE_ENV)
    if env is None or not env.strip():
        return DEFAULT_CACHE_BYTES
    try:
        mb = float(env)
    except ValueError:
        raise ValueError(f"{SGLANG_CACHE_ENV}={env!r} is not a number of MB") from None
    if not mb >= 0:
        raise ValueError(f"{SGLANG_CACHE_ENV} must be >= 0, got {env!r}")
    return int(mb * MIB)


def build_vision_encoder(model_path: str, args: ServerArgs, placement: Placement, dtype: Any) -> VisionEncoder | None:
    """The vision tower of the checkpoint at ``model_path`` in ``dtype`` (the text model's compute dtype),
    replicated on ``placement``'s mesh or on its device; None for a text-only checkpoint.

    Raises:
        CheckpointError: bad ``model.visual.*`` tensors. ValueError: a bad ``vision_config`` or cache size.
    """
    return VisionEncoder.from_checkpoint(model_path, dtype, layout=placement.layout, device=placement.device,
                                         max_patches=args.mm_max_patches, cache_bytes=encoder_cache_bytes(args))


def vision_info(encoder: VisionEncoder | None) -> dict[str, Any] | None:
    """The encoder's figures for /get_server_info (None without one): per device bytes of its weights, its cache
    cap, the largest bucket's activations and their sum (``memory_bytes``, the figure taken out of the budget
    before the KV / GDN split, engine/runner/memory_split.py), the cache in use, the buckets and the counters."""
    if encoder is None:
        return None
    parts = encoder.memory_parts()
    return {
        "weight_bytes": parts["weights"], "cache_cap_bytes": parts["cache_cap"],
        "activation_bytes": parts["activations"], "memory_bytes": sum(parts.values()),
        "cached_bytes": encoder.cached_bytes, "buckets": list(encoder.buckets), "max_patches": encoder.max_patches,
        "dtype": encoder.dtype.name, "precompiled": encoder.precompiled,
        "stats": {"images": encoder.stats.images, "cache_hits": encoder.stats.cache_hits,
                  "encoded": encoder.stats.encoded, "calls": encoder.stats.calls},
    }  # fmt: skip
