"""The server's weight load: checkpoint -> parameters already in their final placement.

Chooses the shardings (the mesh's, parallel/sharding.py, or one device), the FP8 handling
(block-FP8 checkpoints stay FP8 on the devices, the forward multiplies ``Fp8Weight`` leaves directly;
``--quantization fp8`` quantises a bf16 one) and
the integrity check (``--weights-manifest``), then calls ``model.weights.load_params``, which streams
every tensor from the memory-mapped files straight onto the devices that hold it.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import jax
import jax.numpy as jnp

from sglang_tpu_qwen.args.server_args import ServerArgs
from sglang_tpu_qwen.model.config import Qwen35MoeConfig
from sglang_tpu_qwen.model.weights import load_params
from sglang_tpu_qwen.model.weights_manifest import read_manifest
from sglang_tpu_qwen.parallel.mesh import Layout
from sglang_tpu_qwen.parallel.sharding import param_pspecs, shardings
from sglang_tpu_qwen.quant import fp8

logger = logging.getLogger(__name__)


def load_weights(model_path: str, config: Qwen35MoeConfig, dtype: Any, args: ServerArgs,
                 layout: Layout | None, device: Any | None) -> Any:
    """Parameters of ``model_path`` placed on ``layout``'s mesh (experts split over ``expert``, the rest
    replicated), else on ``device`` (default: the first device).

    Raises:
        CheckpointError: a bad checkpoint or a manifest mismatch (model/weights.py).
    """
    if layout is not None:
        def place(abstract: Any) -> Any:
            return shardings(param_pspecs(abstract, layout), layout)
    else:
        target = jax.sharding.SingleDeviceSharding(device if device is not None else jax.devices()[0])

        def place(abstract: Any) -> Any:
            return jax.tree.map(lambda _: target, abstract)
    manifest = read_manifest(args.weights_manifest) if args.weights_manifest else None
    t0 = time.perf_counter()
    # Speculative decoding drafts with the checkpoint's MTP layer (model/mtp.py): loaded like the main layers.
    params = load_params(model_path, config, dtype, keep_fp8=True, quantization=args.quantization,
                         shardings=place, manifest=manifest, mtp=args.speculative_steps > 0)
    logger.info("loaded weights from %s in %.1f s (dtype %s%s%s)", model_path, time.perf_counter() - t0,
                jnp.dtype(dtype).name, f", {_count_fp8(params)} FP8 leaves",
                ", sha256 verified against the manifest" if manifest is not None else "")
    return params


def _count_fp8(params: Any) -> int:
    leaves = jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, fp8.Fp8Weight))
    return sum(isinstance(x, fp8.Fp8Weight) for x in leaves)
