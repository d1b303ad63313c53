"""Model configs the planner knows by name; anything else is a HF ``config.json`` path."""

from __future__ import annotations

import json
from typing import Any

from sglang_tpu_qwen.model.config import Qwen35MoeConfig

# Qwen3.5-397B-A17B text model, from its public config (HF reference). The shared
# expert width (1024) is the released config's value.
QWEN35_397B_A17B: dict[str, Any] = {
    "model_type": "qwen3_5_moe_text",
    "vocab_size": 248320, "hidden_size": 4096, "num_hidden_layers": 60, "full_attention_interval": 4,
    "num_attention_heads": 32, "num_key_value_heads": 2, "head_dim": 256, "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
    "linear_num_key_heads": 16, "linear_num_value_heads": 64, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
    "num_experts": 512, "num_experts_per_tok": 10, "moe_intermediate_size": 1024,
    "shared_expert_intermediate_size": 1024, "norm_topk_prob": True, "tie_word_embeddings": False,
    "max_position_embeddings": 262144, "eos_token_id": 248046, "torch_dtype": "bfloat16",
}  # fmt: skip
BUILTIN_CONFIGS = {"qwen3.5-397b-a17b": QWEN35_397B_A17B}


def load_model_config(name_or_path: str) -> Qwen35MoeConfig:
    """A built-in name (``BUILTIN_CONFIGS``: ``qwen3.5-397b-a17b``) or a HF ``config.json`` path.

    Raises:
        OSError: not a built-in name and no readable file there.
    """
    if name_or_path.lower() in BUILTIN_CONFIGS:
        return Qwen35MoeConfig.from_hf_dict(BUILTIN_CONFIGS[name_or_path.lower()])
    with open(name_or_path, encoding="utf-8") as f:
        return Qwen35MoeConfig.from_hf_dict(json.load(f))
