"""HF safetensors checkpoints <-> our parameter pytree (layout: docs/internals.md).

One table (`_hf_table`) says, for every HF tensor of a Qwen3.5-MoE text model, its shape and
where it lands in the pytree; loading and saving both read it. HF names and shapes follow the
reference model, transformers ``models/qwen3_5_moe/modeling_qwen3_5_moe.py``: linear weights are
``[out, in]`` (we store ``[in, out]``), ``conv1d.weight`` is ``[conv_dim, 1, K]``, fused experts are
``experts.gate_up_proj [E, 2I, H]`` (gate rows first) and ``experts.down_proj [E, H, I]``; released
checkpoints store experts one by one (``experts.{e}.gate_proj.weight [I, H]`` ...), which
transformers fuses on load (its ``conversion_mapping.py``, ``qwen2_moe`` rules).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file
from tqdm.auto import tqdm

from sglang_tpu_qwen.model.config import Qwen35MoeConfig
from sglang_tpu_qwen.model.stacking import stack_params, unstack_params

logger = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Prefixes of the conditional-generation and the causal-LM layouts; the first that matches wins.
_PREFIXES = ("model.language_model.", "model.")
# Block-FP8 releases store `<weight>_scale_inv` beside each quantised weight.
_SCALE_SUFFIX = "_scale_inv"
# Parts of multimodal / multi-token-prediction releases that the text decoder does not use.
_SKIPPED_PREFIXES = ("mtp.", "model.mtp.", "model.visual.", "visual.", "model.language_model.mtp.")

Path_ = tuple[str | int, ...]


class CheckpointError(ValueError):
    """The checkpoint does not match the config: missing, unexpected or mis-shaped tensor, bad files."""


@dataclasses.dataclass(frozen=True)
class _Spec:
    """One HF tensor. ``layout`` says how it maps onto the leaf at ``path``:

    same: identical; t: 2-D transpose; conv: [C, 1, K] -> [C, K];
    expert_t: leaf[expert] = tensor.T; fused_gate_up: [E, 2I, H] -> w_gate, w_up [E, H, I];
    fused_down: [E, H, I] -> [E, I, H].
    """

    path: Path_
    hf_shape: tuple[int, ...]
    layout: str
    expert: int | None = None

    def targets(self) -> list[Path_]:
        if self.layout == "fused_gate_up":
            return [(*self.path, "w_gate"), (*self.path, "w_up")]
        return [self.path]


def param_specs(config: Qwen35MoeConfig, dtype: Any = jnp.bfloat16, *, stacked: bool = True) -> dict[str, Any]:
    """Shapes and dtypes of the parameter pytree (docs/internals.md) as ``jax.ShapeDtypeStruct`` leaves.

    ``dtype`` is the compute dtype of every leaf except ``A_log``, which stays float32. ``stacked``: the
    layers in the scanned layout of model/stacking.py (what ``forward_step`` takes); False gives one
    dict per layer (the loader's and the checkpoint table's view). Useful for ahead-of-time compilation.
    """
    c = config
    h, e, i, i_s = c.hidden_size, c.num_experts, c.moe_intermediate_size, c.shared_expert_intermediate_size
    nq, nkv, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    hv, dv, k = c.linear_num_value_heads, c.linear_value_head_dim, c.linear_conv_kernel_dim

    def s(*shape: int, dt: Any = dtype) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, jnp.dtype(dt))

    def moe() -> dict[str, Any]:
        return {
            "router": s(h, e), "w_gate": s(e, h, i), "w_up": s(e, h, i), "w_down": s(e, i, h),
            "shared_gate": s(h, i_s), "shared_up": s(h, i_s), "shared_down": s(i_s, h),
            "shared_expert_gate": s(h, 1),
        }  # fmt: skip

    layers: list[dict[str, Any]] = []
    for kind in c.layer_types:
        layer: dict[str, Any] = {"input_norm": s(h), "post_attn_norm": s(h)}
        if kind == "full_attention":
            layer["attn"] = {
                "q_proj": s(h, nq * hd * 2), "k_proj": s(h, nkv * hd), "v_proj": s(h, nkv * hd),
                "o_proj": s(nq * hd, h), "q_norm": s(hd), "k_norm": s(hd),
            }  # fmt: skip
        else:
            layer["gdn"] = {
                "in_proj_qkv": s(h, c.gdn_conv_dim), "in_proj_z": s(h, hv * dv),
                "in_proj_b": s(h, hv), "in_proj_a": s(h, hv), "conv1d": s(c.gdn_conv_dim, k),
                "dt_bias": s(hv), "A_log": s(hv, dt=jnp.float32), "norm": s(dv), "out_proj": s(hv * dv, h),
            }  # fmt: skip
        layer["moe"] = moe()
        layers.append(layer)
    params: dict[str, Any] = {"embed": s(c.vocab_size, h), "final_norm": s(h), "layers": layers}
    if not c.tie_word_embeddings:
        params["lm_head"] = s(c.vocab_size, h)
    return stack_params(params, config) if stacked else params


def _leaf(tree: Any, path: Path_) -> Any:
    for p in path:
        tree = tree[p]
    return tree


def _hf_shape(layout: str, leaf_shape: tuple[int, ...]) -> tuple[int, ...]:
    if layout == "same":
        return leaf_shape
    if layout == "t":
        return leaf_shape[::-1]
    if layout == "conv":
        return (leaf_shape[0], 1, leaf_shape[1])
    if layout == "expert_t":
        return leaf_shape[1:][::-1]
    if layout == "fused_gate_up":  # leaf is w_gate [E, H, I]
        return (leaf_shape[0], 2 * leaf_shape[2], leaf_shape[1])
    if layout == "fused_down":
        return (leaf_shape[0], leaf_shape[2], leaf_shape[1])
    raise AssertionError(layout)


_ATTN = {"q_proj": "t", "k_proj": "t", "v_proj": "t", "o_proj": "t", "q_norm": "same", "k_norm": "same"}
_GDN = {
    "in_proj_qkv": "t", "in_proj_z": "t", "in_proj_b": "t", "in_proj_a": "t", "conv1d": "conv",
    "dt_bias": "same", "A_log": "same", "norm": "same", "out_proj": "t",
}  # fmt: skip
# HF tensor name (after "layers.{i}.mlp.") -> our MOE leaf; all [out, in] -> [in, out].
_MOE_DENSE = {
    "gate.weight": "router", "shared_expert.gate_proj.weight": "shared_gate",
    "shared_expert.up_proj.weight": "shared_up", "shared_expert.down_proj.weight": "shared_down",
    "shared_expert_gate.weight": "shared_expert_gate",
}  # fmt: skip
_PER_EXPERT = {"gate_proj": "w_gate", "up_proj": "w_up", "down_proj": "w_down"}


def _hf_table(config: Qwen35MoeConfig, fused_layers: frozenset[int] = frozenset()) -> dict[str, _Spec]:
    """Every HF tensor name (prefix removed) of the text model -> its `_Spec`, in checkpoint order.

    Layers in ``fused_layers`` store their experts fused, the others per expert.
    """
    shapes = param_specs(config, stacked=False)
    table: dict[str, _Spec] = {}

    def add(name: str, path: Path_, layout: str, expert: int | None = None) -> None:
        table[name] = _Spec(path, _hf_shape(layout, _leaf(shapes, path).shape), layout, expert)

    add("embed_tokens.weight", ("embed",), "same")
    for li, kind in enumerate(config.layer_types):
        pre, lp = f"layers.{li}.", ("layers", li)
        add(pre + "input_layernorm.weight", (*lp, "input_norm"), "same")
        add(pre + "post_attention_layernorm.weight", (*lp, "post_attn_norm"), "same")
        if kind == "full_attention":
            for leaf, layout in _ATTN.items():
                add(f"{pre}self_attn.{leaf}.weight", (*lp, "attn", leaf), layout)
        else:
            for leaf, layout in _GDN.items():
                suffix = "" if leaf in ("dt_bias", "A_log") else ".weight"
                add(f"{pre}linear_attn.{leaf}{suffix}", (*lp, "gdn", leaf), layout)
        mp = (*lp, "moe")
        for hf, leaf in _MOE_DENSE.items():
            add(f"{pre}mlp.{hf}", (*mp, leaf), "t")
        if li in fused_layers:
            gate_shape = _leaf(shapes, (*mp, "w_gate")).shape
            table[f"{pre}mlp.experts.gate_up_proj"] = _Spec(
                mp, _hf_shape("fused_gate_up", gate_shape), "fused_gate_up"
            )
            add(f"{pre}mlp.experts.down_proj", (*mp, "w_down"), "fused_down")
        else:
            for e in range(config.num_experts):
                for hf, leaf in _PER_EXPERT.items():
                    add(f"{pre}mlp.experts.{e}.{hf}.weight", (*mp, leaf), "expert_t", e)
    add("norm.weight", ("final_norm",), "same")
    if not config.tie_word_embeddings:
        add("lm_head.weight", ("lm_head",), "same")
    return table


def _canonical(name: str) -> str | None:
    """HF checkpoint name -> table name (prefix removed); None for tensors the text model skips."""
    if name.startswith(_SKIPPED_PREFIXES):
        return None
    if name == "lm_head.weight":
        return name
    for prefix in _PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix) :]
    return name  # bare text-model names load as they are; any other prefix is reported as unexpected


def _checkpoint_files(model_dir: Path) -> dict[str, Path]:
    """Checkpoint tensor name -> safetensors file that holds it."""
    index = model_dir / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: no 'weight_map' object")
        files = {name: model_dir / fname for name, fname in weight_map.items()}
        for f in sorted(set(files.values())):
            if not f.is_file():
                raise CheckpointError(f"{index} names shard {f.name}, which does not exist")
        return files
    single = model_dir / SINGLE_FILE
    if single.is_file():
        with safe_open(single, framework="numpy") as f:
            return dict.fromkeys(f.keys(), single)
    raise CheckpointError(f"{model_dir}: neither {SINGLE_FILE} nor {INDEX_FILE} found")


# safetensors dtypes that some safetensors versions cannot hand to numpy (no numpy dtype of that
# name); ml_dtypes provides them and the fallback reader below views the raw bytes as them.
_ML_DTYPES = {
    "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "F8_E5M2": ml_dtypes.float8_e5m2,
}


class _Shard:
    """One safetensors file, read tensor by tensor through ``safe_open``; dtypes that the installed
    safetensors cannot give numpy are read by memory-mapping their bytes (layout: 8-byte LE header
    length, JSON header with dtype / shape / data_offsets, then the data)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._header: dict[str, Any] | None = None

    def __enter__(self) -> _Shard:
        self._file = safe_open(self.path, framework="numpy")
        self._f = self._file.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._file.__exit__(*exc)

    def get(self, name: str) -> np.ndarray:
        try:
            return self._f.get_tensor(name)
        except Exception:
            if self._f.get_slice(name).get_dtype() not in _ML_DTYPES:
                raise
        return self._raw(name)

    def _raw(self, name: str) -> np.ndarray:
        with open(self.path, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            if self._header is None:
                self._header = json.loads(fh.read(n))
        entry = self._header[name]
        begin, end = entry["data_offsets"]
        raw = np.memmap(self.path, dtype=np.uint8, mode="r", offset=8 + n + begin, shape=(end - begin,))
        return raw.view(_ML_DTYPES[entry["dtype"]]).reshape(entry["shape"])


def _fmt(shape: Any) -> str:
    return "(" + ", ".join(str(int(d)) for d in shape) + ")" if shape is not None else "absent"


def _header_shapes(files: Mapping[str, Path], names: list[str]) -> dict[str, tuple[int, ...]]:
    """Shapes from the safetensors headers (no tensor data is read)."""
    by_file: dict[Path, list[str]] = {}
    for n in names:
        by_file.setdefault(files[n], []).append(n)
    shapes: dict[str, tuple[int, ...]] = {}
    for path, ns in by_file.items():
        with safe_open(path, framework="numpy") as f:
            present = set(f.keys())
            for n in ns:
                if n not in present:
                    raise CheckpointError(f"tensor {n}: listed in {INDEX_FILE} but absent from {path.name}")
                shapes[n] = tuple(f.get_slice(n).get_shape())
    return shapes


@dataclasses.dataclass
class _Plan:
    table: dict[str, _Spec]  # table name -> spec
    to_canon: dict[str, str]  # checkpoint name -> table name, for every tensor to load
    scales: dict[str, str]  # FP8 weight name -> its weight_scale_inv tensor
    block: tuple[int, int]  # FP8 quantisation block [rows, cols]


def _fp8_block(model_dir: Path) -> tuple[int, int]:
    """``quantization_config.weight_block_size`` of config.json (Qwen/DeepSeek FP8 format), else 128x128."""
    try:
        cfg = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        cfg = {}
    block = (cfg.get("quantization_config") or {}).get("weight_block_size") or [128, 128]
    return int(block[0]), int(block[1])


def _plan(files: Mapping[str, Path], config: Qwen35MoeConfig, block: tuple[int, int]) -> _Plan:
    """Check names and header shapes against the config before reading any data.

    Raises CheckpointError for a missing, unexpected, duplicated or mis-shaped tensor.
    """
    to_canon: dict[str, str] = {}
    by_canon: dict[str, str] = {}
    scales: dict[str, str] = {}
    skipped: list[str] = []
    for name in files:
        canon = _canonical(name)
        if canon is None or (canon == "lm_head.weight" and config.tie_word_embeddings):
            skipped.append(name)  # a tied checkpoint may still carry a copy of lm_head
            continue
        if name.endswith(_SCALE_SUFFIX) and name[: -len(_SCALE_SUFFIX)] in files:
            scales[name[: -len(_SCALE_SUFFIX)]] = name
            continue
        if canon in by_canon:
            raise CheckpointError(f"tensor {canon} stored twice: as {by_canon[canon]} and as {name}")
        to_canon[name] = canon
        by_canon[canon] = name
    if skipped:
        kinds = sorted({next((p for p in _SKIPPED_PREFIXES if n.startswith(p)), n) for n in skipped})
        logger.info("skipped %d checkpoint tensors the text model does not use: %s", len(skipped), kinds)

    canon_names = set(to_canon.values())
    fused = frozenset(
        li for li in range(config.num_hidden_layers) if f"layers.{li}.mlp.experts.gate_up_proj" in canon_names
    )
    table = _hf_table(config, fused)
    found_shapes = _header_shapes(files, [*to_canon, *scales.values()])

    unexpected = sorted(n for n, c in to_canon.items() if c not in table)
    if unexpected:
        shown = ", ".join(f"{n} (expected: absent, found: {_fmt(found_shapes[n])})" for n in unexpected[:5])
        more = f" and {len(unexpected) - 5} more" if len(unexpected) > 5 else ""
        raise CheckpointError(f"unexpected tensor(s) for this config: {shown}{more}")
    missing = [c for c in table if c not in canon_names]
    if missing:
        shown = ", ".join(f"{c} (expected: {_fmt(table[c].hf_shape)}, found: absent)" for c in missing[:5])
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise CheckpointError(f"missing tensor(s): {shown}{more}")
    for c, spec in table.items():
        found = found_shapes[by_canon[c]]
        if found != spec.hf_shape:
            raise CheckpointError(
                f"tensor {by_canon[c]}: expected shape {_fmt(spec.hf_shape)} from the config, "
                f"found {_fmt(found)}"
            )
    for weight, scale in scales.items():
        rows, cols = found_shapes[weight][-2:]
        want = (-(-rows // block[0]), -(-cols // block[1]))
        if len(found_shapes[weight]) != 2 or found_shapes[scale] != want:
            raise CheckpointError(
                f"tensor {scale}: expected shape {_fmt(want)} for {block[0]}x{block[1]} blocks of "
                f"{weight} {_fmt(found_shapes[weight])}, found {_fmt(found_shapes[scale])}"
            )
    return _Plan(table, to_canon, scales, block)


def _dequantize(w: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """Block-FP8 weight -> float32: each [block] tile of ``w`` times its entry of ``scale_inv``.

    Format of the Qwen3 / DeepSeek-V3 FP8 releases (``weight_scale_inv`` multiplies, despite its name).
    """
    rows, cols = w.shape
    s = np.repeat(np.repeat(scale_inv.astype(np.float32), block[0], axis=0), block[1], axis=1)
    return w.astype(np.float32) * s[:rows, :cols]


def _to_leaf_layout(x: np.ndarray, spec: _Spec) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """HF tensor -> our layout (views; the caller copies into the compute dtype)."""
    if spec.layout in ("t", "expert_t"):
        return x.T
    if spec.layout == "conv":
        return x[:, 0, :]
    if spec.layout == "fused_gate_up":
        half = x.shape[1] // 2
        return x[:, :half, :].transpose(0, 2, 1), x[:, half:, :].transpose(0, 2, 1)
    if spec.layout == "fused_down":
        return x.transpose(0, 2, 1)
    return x


class _Assembler:
    """Fills the pytree; a leaf assembled from several tensors (per-expert stacks) waits in a
    host buffer until complete, every other tensor goes to the device as soon as it is read."""

    def __init__(self, specs: Any, table: Mapping[str, _Spec]) -> None:
        self.specs = specs
        self.params = jax.tree.map(lambda _: None, specs)
        self.buffers: dict[Path_, np.ndarray] = {}
        self.pending: dict[Path_, int] = {}
        for spec in table.values():
            for t in spec.targets():
                self.pending[t] = self.pending.get(t, 0) + 1

    def put(self, path: Path_, value: np.ndarray, expert: int | None) -> None:
        sds = _leaf(self.specs, path)
        np_dtype = np.dtype(sds.dtype)
        if expert is None and self.pending[path] == 1:
            self._finish(path, np.ascontiguousarray(value, dtype=np_dtype))
            return
        buf = self.buffers.get(path)
        if buf is None:
            buf = self.buffers[path] = np.empty(sds.shape, np_dtype)
        if expert is None:
            buf[...] = value
        else:
            buf[expert] = value
        self.pending[path] -= 1
        if self.pending[path] == 0:
            self._finish(path, self.buffers.pop(path))

    def _finish(self, path: Path_, value: np.ndarray) -> None:
        self.pending[path] = 0
        parent = _leaf(self.params, path[:-1])
        parent[path[-1]] = jnp.asarray(value)


def load_params(model_dir: str | os.PathLike[str], config: Qwen35MoeConfig, dtype: Any = jnp.bfloat16) -> Any:
    """Load a HF safetensors checkpoint into the parameter pytree of docs/internals.md.

    Reads ``model.safetensors`` or the shards named by ``model.safetensors.index.json``, one tensor
    at a time (host memory stays near one tensor, plus one expert stack while it is assembled).
    Accepts the ``model.language_model.`` and ``model.`` prefixes, per-expert or fused experts;
    skips ``mtp.*`` and visual tensors (one log line). Matrices come out ``[in, out]``; every leaf
    is ``dtype`` except ``A_log`` (float32). With ``tie_word_embeddings`` there is no ``lm_head``.

    Block-FP8 checkpoints (a ``weight_scale_inv`` beside a weight, block size from config.json's
    ``quantization_config.weight_block_size``) are dequantised to ``dtype`` on the way in.

    Raises:
        CheckpointError: no checkpoint files; a tensor missing, unexpected, stored twice, or with
            a shape other than the config implies (the message names it and both shapes).
    """
    model_dir = Path(model_dir)
    files = _checkpoint_files(model_dir)
    plan = _plan(files, config, _fp8_block(model_dir))
    table = plan.table
    asm = _Assembler(param_specs(config, dtype, stacked=False), table)
    by_file: dict[Path, list[str]] = {}
    for name in plan.to_canon:
        by_file.setdefault(files[name], []).append(name)
    scale_files: dict[Path, list[str]] = {}
    for scale in plan.scales.values():
        scale_files.setdefault(files[scale], []).append(scale)
    scales: dict[str, np.ndarray] = {}  # small: one float per block
    for path, names in scale_files.items():
        with _Shard(path) as f:
            scales.update({n: np.array(f.get(n)) for n in names})
    with tqdm(total=len(plan.to_canon), desc="Loading weights", unit="tensor") as bar:
        for path, names in by_file.items():
            with _Shard(path) as f:
                for name in names:
                    spec = table[plan.to_canon[name]]
                    raw = f.get(name)
                    if name in plan.scales:
                        raw = _dequantize(raw, scales.pop(plan.scales[name]), plan.block)
                    value = _to_leaf_layout(raw, spec)
                    if spec.layout == "fused_gate_up":
                        for target, part in zip(spec.targets(), value, strict=True):
                            asm.put(target, part, None)
                    else:
                        asm.put(spec.path, value, spec.expert)
                    bar.update(1)
    # The scanned layout (model/stacking.py); the per-layer arrays are freed as the stacks are built.
    return stack_params(asm.params, config)


def to_hf_state_dict(
    params: Any,
    config: Qwen35MoeConfig,
    *,
    prefix: str = "model.language_model.",
    fused_experts: bool = False,
) -> dict[str, np.ndarray]:
    """The inverse of `load_params`: HF tensor name -> numpy array (each leaf keeps its dtype).
    ``params`` has its layers stacked (model/stacking.py).

    ``prefix`` is ``model.language_model.`` (conditional-generation layout, like the release) or
    ``model.``; ``lm_head.weight`` is top level either way. ``fused_experts`` writes
    ``experts.gate_up_proj`` / ``experts.down_proj`` instead of one tensor per expert.
    """
    fused = frozenset(range(config.num_hidden_layers)) if fused_experts else frozenset()
    params = unstack_params(params)
    out: dict[str, np.ndarray] = {}
    for canon, spec in _hf_table(config, fused).items():
        name = canon if canon == "lm_head.weight" else prefix + canon
        if spec.layout == "fused_gate_up":
            gate, up = (np.asarray(_leaf(params, t)) for t in spec.targets())
            x = np.concatenate([gate.transpose(0, 2, 1), up.transpose(0, 2, 1)], axis=1)
        else:
            leaf = np.asarray(_leaf(params, spec.path))
            if spec.layout == "expert_t":
                x = leaf[spec.expert].T
            elif spec.layout == "t":
                x = leaf.T
            elif spec.layout == "conv":
                x = leaf[:, None, :]
            elif spec.layout == "fused_down":
                x = leaf.transpose(0, 2, 1)
            else:
                x = leaf
        out[name] = np.ascontiguousarray(x)
    return out


def _shards(tensors: Mapping[str, np.ndarray], max_bytes: int) -> Iterator[dict[str, np.ndarray]]:
    shard: dict[str, np.ndarray] = {}
    size = 0
    for name, x in tensors.items():
        if shard and size + x.nbytes > max_bytes:
            yield shard
            shard, size = {}, 0
        shard[name] = x
        size += x.nbytes
    if shard:
        yield shard


def save_checkpoint(
    tensors: Mapping[str, np.ndarray], out_dir: str | os.PathLike[str], *, max_shard_bytes: int | None = None
) -> None:
    """Write ``tensors`` as HF safetensors: one ``model.safetensors``, or with ``max_shard_bytes``
    shards ``model-0000i-of-0000n.safetensors`` plus ``model.safetensors.index.json``.

    Files carry the ``{"format": "pt"}`` metadata transformers expects. Output bytes depend only on
    ``tensors`` (deterministic).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"format": "pt"}
    if max_shard_bytes is None:
        save_file(dict(tensors), str(out / SINGLE_FILE), metadata=meta)
        return
    shards = list(_shards(tensors, max_shard_bytes))
    weight_map: dict[str, str] = {}
    for k, shard in enumerate(shards, start=1):
        fname = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / fname), metadata=meta)
        weight_map.update(dict.fromkeys(shard, fname))
    index = {
        "metadata": {"total_size": sum(int(x.nbytes) for x in tensors.values())},
        "weight_map": weight_map,
    }
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n", encoding="utf-8")
