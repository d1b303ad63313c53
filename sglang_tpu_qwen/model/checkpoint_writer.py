"""Write our parameter pytree as a HF safetensors checkpoint (the inverse of model/weights.py's loader).

`to_hf_state_dict` maps each leaf back through model/param_layout.py's table; `save_checkpoint` writes the
tensors as one file or as shards with an index, byte-for-byte deterministic.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file

from sglang_tpu_qwen.model.config import Qwen35MoeConfig
from sglang_tpu_qwen.model.param_layout import INDEX_FILE, SINGLE_FILE, hf_table, leaf_at
from sglang_tpu_qwen.model.stacking import unstack_params


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
    ``model.``; ``lm_head.weight`` is top level either way, and so are the MTP layer's ``mtp.*`` tensors (as
    the release stores them) when ``params`` has ``"mtp"``. ``fused_experts`` writes
    ``experts.gate_up_proj`` / ``experts.down_proj`` instead of one tensor per expert.
    """
    fused = frozenset(range(config.num_hidden_layers)) if fused_experts else frozenset()
    params = unstack_params(params)
    out: dict[str, np.ndarray] = {}
    table = hf_table(config, fused, mtp="mtp" in params, mtp_fused=fused_experts)
    for canon, spec in table.items():
        name = canon if canon == "lm_head.weight" or canon.startswith("mtp.") else prefix + canon
        if spec.layout in ("qkvz", "ba"):
            raise NotImplementedError("writing Qwen3-Next's fused in_proj_qkvz / in_proj_ba is not supported")
        if spec.layout == "fused_gate_up":
            gate, up = (np.asarray(leaf_at(params, t)) for t in spec.targets())
            x = np.concatenate([gate.transpose(0, 2, 1), up.transpose(0, 2, 1)], axis=1)
        else:
            leaf = np.asarray(leaf_at(params, spec.path))
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
