"""The embedded checkpoint plus a random MTP layer (``mtp.*``), for speculative-decoding tests.

The directory links the embedded checkpoint's files (same target weights and tokenizer, so the session's plain
engine is the reference) and adds ``mtp.safetensors`` with the MTP layer's tensors under the release's names,
tied together by a ``model.safetensors.index.json``. Random MTP weights draft badly, which tests exactness at
low acceptance; tests that need drafts to be accepted inject them (test_speculative.py).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from sglang_tpu_qwen.embedded.checkpoint import ensure_embedded_model
from sglang_tpu_qwen.model.config import load_config
from sglang_tpu_qwen.model.param_layout import hf_table
from sglang_tpu_qwen.model.safetensors_file import read_header


def build_mtp_checkpoint(dst: Path, seed: int = 0) -> Path:
    """Write the checkpoint at ``dst`` (created) and return it."""
    src = Path(ensure_embedded_model())
    dst.mkdir(parents=True, exist_ok=True)
    for f in os.listdir(src):
        if not (dst / f).exists():
            os.symlink(src / f, dst / f)
    config = load_config(src)
    rng = np.random.default_rng(seed)
    tensors = {}
    for name, spec in hf_table(config, mtp=True).items():
        if name.startswith("mtp."):
            scale = 0.3 if "norm" in name else 1.0 / np.sqrt(spec.hf_shape[-1])
            tensors[name] = (rng.standard_normal(spec.hf_shape) * scale).astype(ml_dtypes.bfloat16)
    save_file(tensors, str(dst / "mtp.safetensors"), metadata={"format": "pt"})
    weight_map = dict.fromkeys(read_header(src / "model.safetensors")[0], "model.safetensors")
    weight_map.update(dict.fromkeys(tensors, "mtp.safetensors"))
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return dst
