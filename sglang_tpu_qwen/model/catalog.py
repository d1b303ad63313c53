"""The released text configs of the Qwen3.5 family and Qwen3-Next, by name (the planner's ``--model-config``).

Each entry is the ``text_config`` of the release's ``config.json`` in the flat form :meth:`Qwen35MoeConfig.
from_hf_dict` reads (``qwen3_5_moe_text`` / ``qwen3_5_text`` / ``qwen3_next``), with only the fields the
text decoder uses. Shared by every Qwen3.5 release: vocabulary 248,320, head_dim 256, partial RoPE 0.25
with theta 1e7 (M-RoPE sections [11, 11, 10], interleaved), 3 Gated DeltaNet layers then 1 attention layer,
GDN head dims 128 and conv kernel 4, RMSNorm eps 1e-6, 262,144 positions, EOS ``<|im_end|>`` 248046.
Figures checked against the public configs (HF model cards and the transformers / SGLang / vLLM / slime
sources that reproduce them); docs/features.md lists them in a table.
"""

from __future__ import annotations

from typing import Any

from sglang_tpu_qwen.model.config import Qwen35MoeConfig

_QWEN35: dict[str, Any] = {
    "vocab_size": 248320, "head_dim": 256, "rms_norm_eps": 1e-6, "full_attention_interval": 4,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                        "mrope_section": [11, 11, 10], "mrope_interleaved": True},
    "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
    "max_position_embeddings": 262144, "eos_token_id": 248046, "torch_dtype": "bfloat16", "hidden_act": "silu",
}  # fmt: skip


def _moe(layers: int, hidden: int, heads: tuple[int, int], gdn: tuple[int, int], experts: int, top_k: int,
         expert: int, shared: int) -> dict[str, Any]:
    return {**_QWEN35, "model_type": "qwen3_5_moe_text", "num_hidden_layers": layers, "hidden_size": hidden,
            "num_attention_heads": heads[0], "num_key_value_heads": heads[1], "linear_num_key_heads": gdn[0],
            "linear_num_value_heads": gdn[1], "num_experts": experts, "num_experts_per_tok": top_k,
            "moe_intermediate_size": expert, "shared_expert_intermediate_size": shared, "norm_topk_prob": True,
            "tie_word_embeddings": False}


def _dense(layers: int, hidden: int, heads: tuple[int, int], gdn: tuple[int, int], intermediate: int,
           tie: bool) -> dict[str, Any]:
    return {**_QWEN35, "model_type": "qwen3_5_text", "num_hidden_layers": layers, "hidden_size": hidden,
            "num_attention_heads": heads[0], "num_key_value_heads": heads[1], "linear_num_key_heads": gdn[0],
            "linear_num_value_heads": gdn[1], "intermediate_size": intermediate, "tie_word_embeddings": tie}


# name -> flat HF text config. Columns: layers, hidden, (q heads, kv heads), (GDN key heads, value heads), FFN.
MODEL_CONFIGS: dict[str, dict[str, Any]] = {
    "qwen3.5-397b-a17b": _moe(60, 4096, (32, 2), (16, 64), 512, 10, 1024, 1024),
    "qwen3.5-122b-a10b": _moe(48, 3072, (32, 2), (16, 64), 256, 8, 1024, 1024),
    "qwen3.5-35b-a3b": _moe(40, 2048, (16, 2), (16, 32), 256, 8, 512, 512),
    "qwen3.5-27b": _dense(64, 5120, (24, 4), (16, 48), 17408, tie=False),
    "qwen3.5-9b": _dense(32, 4096, (16, 4), (16, 32), 12288, tie=False),
    "qwen3.5-4b": _dense(32, 2560, (16, 4), (16, 32), 9216, tie=True),
    "qwen3.5-2b": _dense(24, 2048, (8, 2), (16, 16), 6144, tie=True),
    "qwen3.5-0.8b": _dense(24, 1024, (8, 2), (16, 16), 3584, tie=True),
    # Qwen3-Next-80B-A3B (Qwen3NextForCausalLM): the Qwen3 vocabulary, plain RoPE, a MoE block in every layer.
    "qwen3-next-80b-a3b": {
        "model_type": "qwen3_next", "vocab_size": 151936, "hidden_size": 2048, "num_hidden_layers": 48,
        "full_attention_interval": 4, "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
        "rms_norm_eps": 1e-6, "rope_theta": 1e7, "partial_rotary_factor": 0.25, "linear_num_key_heads": 16,
        "linear_num_value_heads": 32, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4, "num_experts": 512, "num_experts_per_tok": 10, "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512, "intermediate_size": 5120, "decoder_sparse_step": 1,
        "mlp_only_layers": [], "norm_topk_prob": True, "tie_word_embeddings": False,
        "max_position_embeddings": 262144, "eos_token_id": 151645, "torch_dtype": "bfloat16", "hidden_act": "silu",
    },
}  # fmt: skip


def model_config(name: str) -> Qwen35MoeConfig:
    """The parsed config of a catalog entry (case-insensitive). Raises KeyError naming the known entries."""
    try:
        return Qwen35MoeConfig.from_hf_dict(MODEL_CONFIGS[name.lower()])
    except KeyError:
        raise KeyError(f"unknown model config {name!r}; known: {', '.join(MODEL_CONFIGS)}") from None
