"""Load the vision tower's parameters (``model.visual.*``) from a HF safetensors checkpoint.

The text loader (model/weights.py) skips these tensors; this one reads only them, through the same validated
headers and memory maps (model/safetensors_file.py). Layout of the returned pytree (docs/internals.md "Vision
tower"): matrices ``[in, out]``, the Conv3d kernel flattened to ``[C * T * P * P, D]`` (a patch row of
``pixel_values`` is that flattening), the ``depth`` blocks stacked on a leading dim for ``lax.scan``.

Block FP8: a float8 linear weight with its ``<name>_scale_inv`` (blocks from ``quantization_config.
weight_block_size``) is dequantised to the compute dtype, or with ``keep_fp8`` kept as a ``quant.fp8.Fp8Weight``
(the tower multiplies those through ``MoeBackend.linear``, kernels/moe_backend.py).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from sglang_tpu_qwen.model.safetensors_file import FP8_DTYPES, CheckpointError, SafetensorsFile
from sglang_tpu_qwen.model.vision.config import VisionConfig
from sglang_tpu_qwen.model.weights import checkpoint_files, fp8_block
from sglang_tpu_qwen.quant import fp8_blocks
from sglang_tpu_qwen.quant.fp8 import Fp8Weight

PREFIXES = ("model.visual.", "visual.")  # conditional-generation layout; older Qwen-VL checkpoints
_SCALE_SUFFIX = "_scale_inv"
# HF module (after the prefix, block index removed) -> our leaf path.
_LINEARS = {"attn.qkv": "qkv", "attn.proj": "proj", "mlp.linear_fc1": "fc1", "mlp.linear_fc2": "fc2"}
_NORMS = {"norm1": "norm1", "norm2": "norm2"}
_MERGER = {"norm": "norm", "linear_fc1": "fc1", "linear_fc2": "fc2"}
_BLOCK = re.compile(r"^blocks\.(\d+)\.(.+)\.(weight|bias)$")


def _expected(config: VisionConfig) -> dict[str, tuple[int, ...]]:
    """Every tower tensor (name after the prefix) and its HF shape."""
    d, i, mu, out = config.hidden_size, config.intermediate_size, config.merge_unit, config.out_hidden_size
    c, t, p = config.in_channels, config.temporal_patch_size, config.patch_size
    shapes: dict[str, tuple[int, ...]] = {
        "patch_embed.proj.weight": (d, c, t, p, p), "patch_embed.proj.bias": (d,),
        "pos_embed.weight": (config.num_position_embeddings, d),
        "merger.norm.weight": (d,), "merger.norm.bias": (d,),
        "merger.linear_fc1.weight": (mu * d, mu * d), "merger.linear_fc1.bias": (mu * d,),
        "merger.linear_fc2.weight": (out, mu * d), "merger.linear_fc2.bias": (out,),
    }  # fmt: skip
    block = {"norm1": (d,), "norm2": (d,), "attn.qkv": (3 * d, d), "attn.proj": (d, d),
             "mlp.linear_fc1": (i, d), "mlp.linear_fc2": (d, i)}
    for b in range(config.depth):
        for mod, shape in block.items():
            shapes[f"blocks.{b}.{mod}.weight"] = shape
            shapes[f"blocks.{b}.{mod}.bias"] = shape[:1]
    return shapes


def _leaf_path(name: str) -> tuple[tuple[str, ...], int | None]:
    """Our leaf path of tower tensor ``name`` (after the prefix) and its block index (None outside blocks)."""
    kind = "w" if name.endswith(".weight") else "b"
    if name.startswith("patch_embed."):
        return ("patch_embed", kind), None
    if name == "pos_embed.weight":
        return ("pos_embed",), None
    if name.startswith("merger."):
        return ("merger", _MERGER[name.split(".")[1]], kind), None
    m = _BLOCK.match(name)
    assert m is not None, name
    mod = m.group(2)
    return ("blocks", (_LINEARS | _NORMS)[mod], kind), int(m.group(1))


def _is_linear(path: tuple[str, ...]) -> bool:
    return path[-1] == "w" and path[-2] in ("qkv", "proj", "fc1", "fc2")


def load_vision_params(model_dir: str | os.PathLike[str], config: VisionConfig, dtype: Any = jnp.bfloat16, *,
                       keep_fp8: bool = False, sharding: jax.sharding.Sharding | None = None) -> dict[str, Any]:
    """The tower's parameter pytree from the checkpoint at ``model_dir``, every leaf placed with ``sharding``
    (default: the first device; the server passes a replicated sharding of its mesh).

    Leaves are ``dtype`` (the text model's compute dtype); FP8 linear weights become ``Fp8Weight`` with
    ``keep_fp8`` (then all ``depth`` blocks of one linear must be quantised alike), else are dequantised.

    Raises:
        CheckpointError: no ``model.visual.*`` tensors; a tower tensor missing, unexpected, stored twice or
            shaped other than ``config`` implies; a float8 tensor without its block scale, one that is not a
            linear weight, or (``keep_fp8``) a linear whose blocks are partly quantised. Messages name the tensor.
    """
    model_dir = Path(model_dir)
    files = checkpoint_files(model_dir)
    expected = _expected(config)
    found: dict[str, str] = {}  # name after the prefix -> checkpoint name
    for name in files:
        prefix = next((p for p in PREFIXES if name.startswith(p)), None)
        if prefix is None or name.endswith(_SCALE_SUFFIX):
            continue
        short = name[len(prefix):]
        if short in found:
            raise CheckpointError(f"tensor visual.{short} stored twice: as {found[short]} and as {name}")
        found[short] = name
    if not found:
        raise CheckpointError(f"{model_dir}: no vision tower tensors (model.visual.*) in the checkpoint")
    unexpected = sorted(set(found) - set(expected))
    missing = sorted(set(expected) - set(found))
    if unexpected or missing:
        raise CheckpointError(f"vision tower tensors do not match vision_config: missing {missing[:5]}, "
                              f"unexpected {[found[u] for u in unexpected[:5]]}")
    block = fp8_block(model_dir)
    opened = {p: SafetensorsFile(p) for p in sorted({files[n] for n in found.values()})}
    np_dtype = np.dtype(dtype)
    host: dict[tuple[str, ...], list[Any]] = {}
    try:
        for short, name in sorted(found.items()):
            f = opened[files[name]]
            info = f.tensors[name]
            if info.shape != expected[short]:
                raise CheckpointError(f"tensor {name}: expected shape {expected[short]} from vision_config, "
                                      f"found {info.shape}")
            path, index = _leaf_path(short)
            x = f.get(name)
            value: Any
            if info.dtype in FP8_DTYPES:
                scale_name = name + _SCALE_SUFFIX
                if scale_name not in files:
                    raise CheckpointError(f"tensor {name} is stored as {info.dtype} but its block scale {scale_name} "
                                          "is absent from the checkpoint")
                if not _is_linear(path):
                    raise CheckpointError(f"tensor {name}: only the tower's linear weights may be block-FP8")
                if files[scale_name] not in opened:
                    opened[files[scale_name]] = SafetensorsFile(files[scale_name])
                sf = opened[files[scale_name]]
                s = sf.get(scale_name).astype(np.float32)
                if s.shape != fp8_blocks.scale_shape(x.shape, block):
                    raise CheckpointError(f"tensor {scale_name}: expected shape "
                                          f"{fp8_blocks.scale_shape(x.shape, block)}, found {s.shape}")
                if keep_fp8 and x.dtype == np.dtype(ml_dtypes.float8_e4m3fn):
                    value = (np.ascontiguousarray(x.T), np.ascontiguousarray(s.T))
                else:
                    value = np.asarray(fp8_blocks.dequantize(x, s, block).T, dtype=np_dtype)
            elif path == ("patch_embed", "w"):  # Conv3d [D, C, T, P, P] -> [C*T*P*P, D]
                value = np.asarray(x.reshape(x.shape[0], -1).T, dtype=np_dtype)
            elif x.ndim == 2 and path[-1] == "w":
                value = np.asarray(x.T, dtype=np_dtype)
            else:
                value = np.asarray(x, dtype=np_dtype)
            slot = host.setdefault(path, [None] * (config.depth if index is not None else 1))
            slot[index or 0] = value
    finally:
        for f in opened.values():
            f.close()
    target = sharding or jax.sharding.SingleDeviceSharding(jax.devices()[0])
    params: dict[str, Any] = {}
    for path, values in host.items():
        stacked = path[0] == "blocks"
        kinds = {isinstance(v, tuple) for v in values}
        if len(kinds) > 1:
            raise CheckpointError(f"vision blocks store {'.'.join(path[1:])} partly as block-FP8: with keep_fp8 "
                                  "every block must be quantised alike")
        if kinds == {True}:
            q = np.stack([v[0] for v in values]) if stacked else values[0][0]
            s = np.stack([v[1] for v in values]) if stacked else values[0][1]
            leaf: Any = Fp8Weight(q=jax.device_put(q, target), scale=jax.device_put(s, target),
                                  block=(block[1], block[0]))
        else:
            leaf = jax.device_put(np.stack(values) if stacked else values[0], target)
        node = params
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = leaf
    return params


def vision_param_bytes(params: dict[str, Any]) -> int:
    """Bytes of one replica of the tower's parameters (every leaf, FP8 weights at their stored size)."""
    return sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(params))
