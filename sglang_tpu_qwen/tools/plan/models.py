"""Model configs the planner knows by name; anything else is a HF ``config.json`` path."""

from __future__ import annotations

import json

from sglang_tpu_qwen.model.catalog import MODEL_CONFIGS
from sglang_tpu_qwen.model.config import Qwen35MoeConfig

# Named model configs (the released text configs): model/catalog.py.
BUILTIN_CONFIGS = MODEL_CONFIGS


def load_model_config(name_or_path: str) -> Qwen35MoeConfig:
    """A built-in name (``BUILTIN_CONFIGS``: ``qwen3.5-397b-a17b``, ``qwen3.5-27b``, ...) or a HF ``config.json``
    path.

    Raises:
        OSError: not a built-in name and no readable file there.
    """
    if name_or_path.lower() in BUILTIN_CONFIGS:
        return Qwen35MoeConfig.from_hf_dict(BUILTIN_CONFIGS[name_or_path.lower()])
    with open(name_or_path, encoding="utf-8") as f:
        return Qwen35MoeConfig.from_hf_dict(json.load(f))
