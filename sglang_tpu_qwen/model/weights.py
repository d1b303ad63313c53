"""Load a HF safetensors checkpoint into our parameter pytree (layout: docs/internals.md).

Reads the checkpoint's files through validated headers and memory maps (model/safetensors_file.py), matches
every tensor against model/param_layout.py's table (names, shapes, block-FP8 scales), and places each leaf
straight into its sharding (model/weight_placement.py). Writing a checkpoint is model/checkpoint_writer.py.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from tqdm.auto import tqdm

from sglang_tpu_qwen.model.config import Qwen35MoeConfig
from sglang_tpu_qwen.model.param_layout import (
    INDEX_FILE,
    SINGLE_FILE,
    SKIPPED_PREFIXES,
    HfSpec,
    LeafPath,
    canonical_name,
    hf_table,
    kv_scale_name,
    leaf_at,
    param_specs,
    split_grouped,
)
from sglang_tpu_qwen.model.safetensors_file import (
    FP8_DTYPES,
    CheckpointError,
    SafetensorsFile,
    TensorInfo,
    read_header,
)
from sglang_tpu_qwen.model.stacking import layer_period
from sglang_tpu_qwen.model.weight_placement import place
from sglang_tpu_qwen.model.weights_manifest import check_file_set, verify_digests
from sglang_tpu_qwen.quant import fp8_blocks
from sglang_tpu_qwen.quant.fp8 import BLOCK, QUANTISED_LEAVES, Fp8Weight
from sglang_tpu_qwen.quant.fp8_blocks import scale_shape

__all__ = ["CheckpointError", "checkpoint_files", "fp8_block", "load_params"]

logger = logging.getLogger(__name__)

# Block-FP8 releases store `<weight>_scale_inv` beside each quantised weight.
_SCALE_SUFFIX = "_scale_inv"
# Leaves kept in float32 whatever the compute dtype: the GDN decay's log, the FP8 KV cache scales.
_FLOAT32_LEAVES = frozenset({"A_log", "k_scale", "v_scale"})


def checkpoint_files(model_dir: Path) -> dict[str, Path]:
    """Checkpoint tensor name -> safetensors file that holds it (the index's weight map, else the single file's
    header). Raises CheckpointError: no checkpoint, a bad index, or a shard it names is missing."""
    index = model_dir / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map")
        except (UnicodeDecodeError, ValueError, AttributeError) as e:
            raise CheckpointError(f"{index}: not a JSON object with a 'weight_map' ({e})") from None
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: no 'weight_map' object")
        files = {name: model_dir / fname for name, fname in weight_map.items()}
        for f in sorted(set(files.values())):
            if not f.is_file():
                raise CheckpointError(f"{index} names shard {f.name}, which does not exist")
        return files
    single = model_dir / SINGLE_FILE
    if single.is_file():
        return dict.fromkeys(read_header(single)[0], single)
    raise CheckpointError(f"{model_dir}: neither {SINGLE_FILE} nor {INDEX_FILE} found")


def _fmt(shape: Any) -> str:
    return "(" + ", ".join(str(int(d)) for d in shape) + ")" if shape is not None else "absent"


@dataclasses.dataclass
class _Tensor:
    """One checkpoint tensor to read, with its block scale when it is stored as float8."""

    name: str
    file: SafetensorsFile
    info: TensorInfo
    spec: HfSpec
    scale: _Tensor | None = None

    @property
    def fp8(self) -> bool:
        return self.scale is not None


@dataclasses.dataclass
class _Leaf:
    """One leaf of the output pytree and the tensors it is read from (several for a per-expert stack)."""

    path: LeafPath
    shape: tuple[int, ...]
    dtype: Any  # numpy dtype of a dense leaf
    tensors: list[tuple[_Tensor, str | None]]  # (tensor, "gate" | "up" for a fused gate_up, else None)
    stored_fp8: bool
    out_fp8: bool

    @property
    def per_expert(self) -> bool:
        return self.tensors[0][0].spec.expert is not None

    @property
    def nbytes(self) -> int:
        """Checkpoint bytes read for this leaf (half of a fused gate_up goes to each of its two leaves)."""
        total = 0
        for t, part in self.tensors:
            n = t.info.nbytes + (t.scale.info.nbytes if t.scale is not None else 0)
            total += n // 2 if part else n
        return total


@dataclasses.dataclass
class _Plan:
    leaves: list[_Leaf]
    files: dict[Path, SafetensorsFile]
    block: tuple[int, int]  # FP8 quantisation block [rows, cols] of the checkpoint's [out, in] tensors
    kv_scales: bool = False  # the attention layers carry FP8 KV cache scales (param_layout.kv_scale_name)
    mtp: bool = False  # the MTP layer is loaded too (params["mtp"])


def fp8_block(model_dir: Path) -> tuple[int, int]:
    """``quantization_config.weight_block_size`` of config.json (Qwen/DeepSeek FP8 format), else 128x128."""
    try:
        cfg = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        cfg = {}
    block = (cfg.get("quantization_config") or {}).get("weight_block_size") or [128, 128]
    if len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block):
        raise CheckpointError(f"config.json: quantization_config.weight_block_size {block!r} is not [rows, cols]")
    return int(block[0]), int(block[1])


def _check_scale(weight: _Tensor, scale: _Tensor, block: tuple[int, int]) -> None:
    """A scale belongs to a float8 weight and has one float per block (all or nothing, #13 item 7)."""
    w, s = weight.info, scale.info
    if w.dtype not in FP8_DTYPES:
        raise CheckpointError(f"tensor {scale.name} is a block scale, but its weight {weight.name} is stored as "
                              f"{w.dtype}, not float8")
    if s.dtype not in ("F32", "BF16", "F16"):
        raise CheckpointError(f"tensor {scale.name} (scale of {weight.name}): dtype {s.dtype}, expected F32")
    want = scale_shape(w.shape, block) if len(w.shape) >= 2 else None
    if s.shape != want:
        raise CheckpointError(
            f"tensor {scale.name}: expected shape {_fmt(want)} for {block[0]}x{block[1]} blocks of "
            f"{weight.name} {_fmt(w.shape)}, found {_fmt(s.shape)}"
        )


def _plan(
    files: Mapping[str, Path], config: Qwen35MoeConfig, block: tuple[int, int], dtype: Any, keep_fp8: bool,
    quantize: bool, mtp: bool = False,
) -> _Plan:
    """Check names, dtypes, shapes and FP8 scales against the config before reading any data.

    Raises CheckpointError for a missing, unexpected, duplicated or mis-shaped tensor, a float8 weight
    without its scale, a scale without its float8 weight or of the wrong shape, and a leaf (expert
    stack) whose tensors are partly quantised; with ``mtp``, a checkpoint without ``mtp.*`` tensors.
    """
    opened = {p: SafetensorsFile(p) for p in sorted(set(files.values()))}
    weights: dict[str, str] = {}  # table name -> checkpoint name
    scale_names: list[str] = []
    skipped: list[str] = []
    for name, path in files.items():
        if name not in opened[path].tensors:
            raise CheckpointError(f"tensor {name}: listed in {INDEX_FILE} but absent from {path.name}")
        canon = canonical_name(name, mtp)
        if canon is None or (canon == "lm_head.weight" and config.tie_word_embeddings):
            skipped.append(name)  # a tied checkpoint may still carry a copy of lm_head
            continue
        canon = kv_scale_name(canon) or canon  # one name for each spelling of a KV cache scale
        if name.endswith(_SCALE_SUFFIX):
            if name[: -len(_SCALE_SUFFIX)] not in files:
                raise CheckpointError(f"tensor {name} is a block scale, but its weight "
                                      f"{name[: -len(_SCALE_SUFFIX)]} is absent from the checkpoint")
            scale_names.append(name)
            continue
        if canon in weights:
            raise CheckpointError(f"tensor {canon} stored twice: as {weights[canon]} and as {name}")
        weights[canon] = name
    if skipped:
        kinds = sorted({next((p for p in SKIPPED_PREFIXES if n.startswith(p)), n) for n in skipped})
        logger.info("skipped %d checkpoint tensors the text model does not use: %s", len(skipped), kinds)

    def tensor(name: str, spec: HfSpec) -> _Tensor:
        return _Tensor(name, opened[files[name]], opened[files[name]].tensors[name], spec)

    fused = frozenset(
        li for li in range(config.num_hidden_layers) if f"layers.{li}.mlp.experts.gate_up_proj" in weights
    )
    if mtp and not any(c.startswith("mtp.") for c in weights):
        raise CheckpointError("speculative decoding with the MTP layer needs the checkpoint's mtp.* tensors "
                              "(mtp.fc.weight, mtp.layers.0.*, ...); this checkpoint has none")
    # KV cache scales are all or nothing, like block FP8: with one present, every attention layer needs both.
    kv_scales = any(kv_scale_name(c) for c in weights)
    table = hf_table(config, fused, kv_scales, mtp=mtp,
                     mtp_fused="mtp.layers.0.mlp.experts.gate_up_proj" in weights)
    unexpected = sorted(n for c, n in weights.items() if c not in table)
    if unexpected:
        shown = ", ".join(
            f"{n} (expected: absent, found: {_fmt(opened[files[n]].tensors[n].shape)})" for n in unexpected[:5]
        )
        more = f" and {len(unexpected) - 5} more" if len(unexpected) > 5 else ""
        raise CheckpointError(f"unexpected tensor(s) for this config: {shown}{more}")
    missing = [c for c in table if c not in weights]
    if missing:
        shown = ", ".join(f"{c} (expected: {_fmt(table[c].hf_shape)}, found: absent)" for c in missing[:5])
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise CheckpointError(f"missing tensor(s): {shown}{more}")
    by_name = {name: tensor(name, table[c]) for c, name in weights.items()}
    for t in by_name.values():
        if t.spec.layout == "scalar":
            if t.info.shape not in ((), (1,)) or t.info.dtype not in ("F32", "BF16", "F16"):
                raise CheckpointError(f"tensor {t.name}: a KV cache scale must be one float (shape [] or [1]), "
                                      f"found {t.info.dtype} {_fmt(t.info.shape)}")
            continue
        if t.info.shape != t.spec.hf_shape:
            raise CheckpointError(
                f"tensor {t.name}: expected shape {_fmt(t.spec.hf_shape)} from the config, found {_fmt(t.info.shape)}"
            )
    for s in scale_names:
        w = by_name.get(s[: -len(_SCALE_SUFFIX)])
        if w is None:  # the scale of a skipped tensor (mtp, a tied lm_head copy)
            continue
        w.scale = _Tensor(s, opened[files[s]], opened[files[s]].tensors[s], w.spec)
        _check_scale(w, w.scale, block)
    for t in by_name.values():
        if t.info.dtype in FP8_DTYPES and t.scale is None:
            raise CheckpointError(f"tensor {t.name} is stored as {t.info.dtype} but its block scale "
                                  f"{t.name}{_SCALE_SUFFIX} is absent from the checkpoint")
        if t.fp8 and t.spec.layout == "fused_gate_up" and (t.info.shape[1] // 2) % block[0]:
            raise CheckpointError(f"tensor {t.name}: the gate / up halves ({t.info.shape[1] // 2} rows) do not "
                                  f"split on a {block[0]}-row block boundary of {t.scale.name}")  # type: ignore[union-attr]

    shapes = param_specs(config, stacked=False, kv_scales=kv_scales, mtp=mtp)
    np_dtype = np.dtype(dtype)
    by_leaf: dict[LeafPath, list[tuple[_Tensor, str | None]]] = {}
    for t in by_name.values():
        for part, target in t.spec.parts():
            by_leaf.setdefault(target, []).append((t, part))
    leaves: list[_Leaf] = []
    for path, ts in by_leaf.items():
        ts.sort(key=lambda tp: tp[0].spec.expert or 0)
        kinds = {t.fp8 for t, _ in ts}
        if len(kinds) > 1:
            q = next(t for t, _ in ts if t.fp8)
            d = next(t for t, _ in ts if not t.fp8)
            raise CheckpointError(f"leaf {'.'.join(map(str, path))} mixes block-FP8 and unquantised tensors: "
                                  f"{q.name} has {q.scale.name}, {d.name} is {d.info.dtype} without a scale")  # type: ignore[union-attr]
        stored_fp8 = kinds == {True}
        quantisable = path[-1] in QUANTISED_LEAVES
        out_fp8 = quantisable and ((stored_fp8 and keep_fp8) or (quantize and not stored_fp8))
        leaf_dtype = np.dtype(np.float32) if path[-1] in _FLOAT32_LEAVES else np_dtype
        leaves.append(_Leaf(path, tuple(leaf_at(shapes, path).shape), leaf_dtype, ts, stored_fp8, out_fp8))
    if kv_scales:
        logger.info("checkpoint has FP8 KV cache scales (k_scale / v_scale) for its %d attention layers; an "
                    "FP8 KV cache (--kv-cache-dtype fp8_e4m3) uses them", config.num_attn_layers)
    return _Plan(leaves, opened, block, kv_scales, mtp)


def _hf_part(t: _Tensor, part: str | None, experts: slice | None, block: tuple[int, int]
             ) -> tuple[np.ndarray, np.ndarray | None]:
    """(values, block scale or None) of one tensor in the checkpoint's layout, restricted to ``experts``
    (fused layouts) and to one half of a fused gate_up (views into the memory map; no bytes copied)."""
    x = t.file.get(t.name)
    s = t.scale.file.get(t.scale.name) if t.scale is not None else None
    if t.spec.layout in ("fused_gate_up", "fused_down"):
        e = experts or slice(None)
        x = x[e]
        s = s[e] if s is not None else None
        if part is not None:
            half = x.shape[1] // 2
            x = x[:, :half] if part == "gate" else x[:, half:]
            if s is not None:
                sh = half // block[0]
                s = s[:, :sh] if part == "gate" else s[:, sh:]
    return x, s


def _to_leaf_layout(x: np.ndarray, layout: str) -> np.ndarray:
    """Checkpoint layout -> ours (a view): [out, in] -> [in, out] for matrices, conv [C, 1, K] -> [C, K]."""
    if layout in ("t", "expert_t"):
        return x.T
    if layout == "conv":
        return x[:, 0, :]
    if layout == "scalar":
        return x.reshape(())
    if layout in ("fused_gate_up", "fused_down"):
        return x.transpose(0, 2, 1)
    return x


def _mark_read(t: _Tensor, experts: slice | None) -> None:
    """Tell the file's digest which bytes were read (rows ``experts`` of a fused [E, ...] tensor)."""
    for tt in (t, t.scale):
        if tt is None or tt.file.digest is None:
            continue
        begin, end = tt.info.begin, tt.info.end
        if experts is not None and tt.spec.layout in ("fused_gate_up", "fused_down"):
            row = (end - begin) // tt.info.shape[0]
            start, stop, _ = experts.indices(tt.info.shape[0])
            begin, end = begin + start * row, begin + stop * row
        tt.file.digest.consumed(begin, end)


def _read_leaf(leaf: _Leaf, experts: slice | None, block: tuple[int, int]) -> Any:
    """Host arrays of ``leaf`` for the experts ``experts`` (dim 0 of an expert stack; None: all, or not a
    stack): a dense array in ``leaf.dtype``, or ``(q float8_e4m3fn, scale float32)`` in our layout."""
    units = leaf.tensors
    stack = leaf.per_expert
    if stack:
        units = units[experts or slice(None)]
    outs_q: list[np.ndarray] = []
    outs_s: list[np.ndarray] = []
    leaf_block = (block[1], block[0])  # blocks transpose with the matrix
    for t, part in units:
        x, s = _hf_part(t, part, None if stack else experts, block)
        layout = t.spec.layout
        if layout in ("qkvz", "ba"):  # Qwen3-Next: regroup the rows per key head
            aligned = all(w % block[0] == 0 for w in t.spec.groups)
            if leaf.out_fp8 and leaf.stored_fp8 and aligned:
                # Every part starts on a block row: q rows and scale rows regroup alike, bit for bit.
                q = split_grouped(x, t.spec.groups, part, np).T  # type: ignore[arg-type]
                sc = split_grouped(s, tuple(w // block[0] for w in t.spec.groups), part, np).T.astype(np.float32)  # type: ignore[arg-type]
            else:  # dequantised (a block straddles two parts), then quantised again if the leaf is FP8
                dense = fp8_blocks.dequantize(x, s, block) if s is not None else x
                dense = split_grouped(dense, t.spec.groups, part, np).T  # type: ignore[arg-type]
                if leaf.out_fp8:
                    q, sc = fp8_blocks.quantize(dense, leaf_block if leaf.stored_fp8 else BLOCK)
                else:
                    q, sc = np.asarray(dense, dtype=leaf.dtype), None
        elif leaf.out_fp8 and leaf.stored_fp8 and x.dtype == np.dtype(ml_dtypes.float8_e4m3fn):
            q, sc = _to_leaf_layout(x, layout), _to_leaf_layout(s, layout).astype(np.float32)  # type: ignore[arg-type]
        else:
            dense = fp8_blocks.dequantize(x, s, block) if s is not None else x
            dense = _to_leaf_layout(dense, layout)
            if leaf.out_fp8:
                q, sc = fp8_blocks.quantize(dense, leaf_block if leaf.stored_fp8 else BLOCK)
            else:
                q, sc = np.asarray(dense, dtype=leaf.dtype), None
        outs_q.append(np.ascontiguousarray(q).reshape(q.shape))  # ascontiguousarray makes a 0-d array 1-d
        if sc is not None:
            outs_s.append(np.ascontiguousarray(sc))
        _mark_read(t, None if stack else experts)
    if stack:
        q = np.stack(outs_q)
        sc = np.stack(outs_s) if outs_s else None
    else:
        q, sc = outs_q[0], (outs_s[0] if outs_s else None)
    return (q, sc) if leaf.out_fp8 else q


@dataclasses.dataclass
class _OutLeaf:
    """One leaf of the returned pytree: one checkpoint leaf, or (stacked) the same leaf of every layer
    group, ``members[g]`` being layer ``g * period + j``."""

    path: LeafPath
    members: list[_Leaf]
    stacked: bool
    abstract: Any = None

    @property
    def nbytes(self) -> int:
        return sum(m.nbytes for m in self.members)


def _leaf_abstract(leaf: _Leaf, block: tuple[int, int], lead: tuple[int, ...]) -> Any:
    shape = (*lead, *leaf.shape)
    if not leaf.out_fp8:
        return jax.ShapeDtypeStruct(shape, leaf.dtype)
    blk = (block[1], block[0]) if leaf.stored_fp8 else BLOCK
    return Fp8Weight(q=jax.ShapeDtypeStruct(shape, jnp.float8_e4m3fn),
                     scale=jax.ShapeDtypeStruct(scale_shape(shape, blk), jnp.float32), block=blk)


def _out_leaves(plan: _Plan, config: Qwen35MoeConfig, stacked: bool) -> tuple[list[_OutLeaf], Any]:
    """The returned pytree's leaves and its skeleton (dicts / lists with None leaves).

    Raises:
        CheckpointError: stacked, and the layers of one group position differ in quantisation.
    """
    if not stacked:
        outs = [_OutLeaf(lf.path, [lf], False) for lf in plan.leaves]
        skeleton = jax.tree.map(lambda _: None, param_specs(config, stacked=False, kv_scales=plan.kv_scales,
                                                            mtp=plan.mtp))
    else:
        period = layer_period(config)
        groups: dict[LeafPath, list[_Leaf]] = {}
        outs = []
        for lf in plan.leaves:
            if lf.path[0] == "layers":
                groups.setdefault(("layers", int(lf.path[1]) % period, *lf.path[2:]), []).append(lf)
            else:
                outs.append(_OutLeaf(lf.path, [lf], False))
        for path, members in groups.items():
            members.sort(key=lambda m: int(m.path[1]))
            kinds = {(m.out_fp8, m.stored_fp8) for m in members}
            if len(kinds) > 1:
                a = next(m for m in members if (m.out_fp8, m.stored_fp8) == min(kinds))
                b = next(m for m in members if (m.out_fp8, m.stored_fp8) == max(kinds))
                raise CheckpointError(
                    f"layers {a.path[1]} and {b.path[1]} store {'.'.join(map(str, a.path[2:]))} differently "
                    "(one block-FP8, one not): a stacked layer group needs them alike")
            outs.append(_OutLeaf(path, members, True))
        skeleton = jax.tree.map(lambda _: None, param_specs(config, stacked=True, kv_scales=plan.kv_scales,
                                                            mtp=plan.mtp))
    for out in outs:
        lead = (len(out.members),) if out.stacked else ()
        out.abstract = _leaf_abstract(out.members[0], plan.block, lead)
        leaf_at(skeleton, out.path[:-1])[out.path[-1]] = out.abstract
    return outs, skeleton


def load_params(
    model_dir: str | os.PathLike[str],
    config: Qwen35MoeConfig,
    dtype: Any = jnp.bfloat16,
    *,
    keep_fp8: bool = False,
    quantization: str | None = None,
    shardings: Callable[[Any], Any] | None = None,
    manifest: Mapping[str, str] | None = None,
    stacked: bool = True,
    mtp: bool = False,
) -> Any:
    """Load a HF safetensors checkpoint into the parameter pytree of docs/internals.md.

    Reads ``model.safetensors`` or the shards named by ``model.safetensors.index.json`` through
    validated headers and memory maps (model/safetensors_file.py). Accepts the ``model.language_model.``
    and ``model.`` prefixes, per-expert or fused experts; skips ``mtp.*`` and visual tensors (one log
    line). Matrices come out ``[in, out]``; every dense leaf is ``dtype`` except ``A_log`` (float32).
    With ``tie_word_embeddings`` there is no ``lm_head``. FP8 KV cache scales (``self_attn.k_scale`` /
    ``v_scale`` and the spellings model/param_layout.py lists), when present, become float32 scalar leaves
    ``attn.k_scale`` / ``attn.v_scale`` of every attention layer (all layers or none).

    ``mtp``: also load the multi-token-prediction layer (``mtp.*``, any of param_layout.MTP_PREFIXES) into
    ``params["mtp"]`` (layout: model/param_layout.py ``param_specs(mtp=True)``; never stacked; its experts split
    like the main layers' by ``shardings``, block FP8 kept as for the main layers).

    ``stacked``: the layer-scan layout (COORDINATION.md contract 1): ``params["layers"]`` is a list of
    ``layer_period(config)`` dicts whose leaves have a leading dim G = layers / period, layer
    ``g * period + j`` at ``params["layers"][j][name][g]`` (expert stacks ``[G, E, in, out]``).

    Block FP8 (a float8 weight with ``<weight>_scale_inv`` beside it; block size from config.json's
    ``quantization_config.weight_block_size``, edge blocks may be partial): with ``keep_fp8`` the
    quantised linear weights (``quant.fp8.QUANTISED_LEAVES``) become ``Fp8Weight(q, scale, block)``
    leaves, q and the scale grid transposed into our layout; every other FP8 tensor (and all of them
    without ``keep_fp8``) is dequantised to ``dtype``. ``quantization="fp8"`` (SGLang's
    ``--quantization fp8``) also quantises the dense ``QUANTISED_LEAVES`` of a bf16 checkpoint into
    128 x 128-block ``Fp8Weight`` leaves.

    Placement: ``shardings(abstract_tree) -> tree of jax.sharding.Sharding`` (the abstract tree has
    ``ShapeDtypeStruct`` / abstract ``Fp8Weight`` leaves); each device receives only its own shard,
    read straight from the memory-mapped files (model/weight_placement.py: an expert stack split over
    devices is never assembled whole on a device or in host memory; the host holds one shard of one
    layer at a time). Default: the first device. A tqdm bar shows GB read and GB/s.

    ``manifest`` (file name -> sha256, model/weights_manifest.py): every safetensors file is hashed
    from the same bytes the loader reads, files the loader does not read are hashed whole; a missing,
    extra or mismatching file raises.

    Raises:
        CheckpointError: no checkpoint files; a corrupted or truncated file (header, offsets, sizes);
            a tensor missing, unexpected, stored twice, or shaped other than the config implies; a
            float8 weight without its scale, a scale without its weight or of the wrong shape, an
            expert stack mixing quantised and unquantised tensors (messages name the tensors and file);
            a manifest mismatch (names the file); ``mtp`` and no ``mtp.*`` tensor in the checkpoint.
        ValueError: ``quantization`` other than None / "fp8".
    """
    if quantization not in (None, "fp8"):
        raise ValueError(f"quantization must be None or 'fp8', got {quantization!r}")
    model_dir = Path(model_dir)
    if manifest is not None:
        check_file_set(model_dir, manifest)
    files = checkpoint_files(model_dir)
    plan = _plan(files, config, fp8_block(model_dir), dtype, keep_fp8 or quantization == "fp8",
                 quantization == "fp8", mtp)
    outs, params = _out_leaves(plan, config, stacked)
    if shardings is not None:
        sh_tree = shardings(params)
    else:
        dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        sh_tree = jax.tree.map(lambda _: dev, params)
    for f in plan.files.values():
        f.hash_bytes = manifest is not None
    # Leaves in file order, so the manifest digests advance with the reads.
    outs.sort(key=lambda o: (str(o.members[0].tensors[0][0].file.path), o.members[0].tensors[0][0].info.begin))
    with tqdm(total=sum(o.nbytes for o in outs), desc="Loading weights", unit="B", unit_scale=True,
              unit_divisor=1000) as bar:
        for out in outs:
            def read(g: int | None, experts: slice | None, out: _OutLeaf = out) -> Any:
                member = out.members[0 if g is None else g]
                host = _read_leaf(member, experts, plan.block)
                if experts is None:  # the whole leaf (a scalar KV cache scale has no rows to split)
                    bar.update(member.nbytes)
                else:
                    n = member.shape[0]
                    bar.update(member.nbytes * len(range(*experts.indices(n))) // n)
                return host

            value = place(out.abstract, leaf_at(sh_tree, out.path), read, out.stacked)
            leaf_at(params, out.path[:-1])[out.path[-1]] = value
    if manifest is not None:
        digests = {f.path.name: f.sha256() for f in plan.files.values()}
        verify_digests(model_dir, manifest, digests)
    for f in plan.files.values():
        f.close()
    return params
