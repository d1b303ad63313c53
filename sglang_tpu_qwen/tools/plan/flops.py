"""Analytic matmul flops of the model, a cross-check of XLA's cost analysis."""

from __future__ import annotations

from sglang_tpu_qwen.model.config import Qwen35MoeConfig


def attention_flops_per_token(config: Qwen35MoeConfig, context: float) -> float:
    """Scores and values of one token against ``context`` visible keys, over all attention layers
    (2 flops per multiply-add)."""
    c = config
    return float(c.num_attn_layers * 2 * 2 * c.num_attention_heads * c.head_dim * context)


def analytic_flops_per_token(config: Qwen35MoeConfig, context: int) -> float:
    """Matmul flops (2 per multiply-add) of one token through the model at ``context`` visible keys,
    counting the k routed experts and the shared expert (or a dense layer's SwiGLU), all projections and
    attention scores / values;
    not the lm_head (counted per row by the caller)."""
    c = config
    h, hd = c.hidden_size, c.head_dim
    attn = 2 * h * (c.num_attention_heads * hd * 2 + 2 * c.num_key_value_heads * hd)
    attn += 2 * c.num_attention_heads * hd * h
    hv, dv, dk = c.linear_num_value_heads, c.linear_value_head_dim, c.linear_key_head_dim
    gdn = 2 * h * (c.gdn_conv_dim + hv * dv + 2 * hv) + 2 * hv * dv * h + 2 * 2 * hv * dk * dv
    moe = 2 * h * c.num_experts + c.num_experts_per_tok * 6 * h * c.moe_intermediate_size
    moe += 6 * h * c.shared_expert_intermediate_size
    mlp = sum(moe if t == "moe" else 6 * h * c.intermediate_size for t in c.mlp_types)  # dense: one SwiGLU
    return float(c.num_attn_layers * attn + c.num_gdn_layers * gdn + mlp) + (
        attention_flops_per_token(c, context))


def chunk_flops(config: Qwen35MoeConfig, tokens: int, prefix: int) -> float:
    """Matmul flops (2 per multiply-add) of one row feeding ``tokens`` new tokens after ``prefix`` cached ones:
    each at :func:`analytic_flops_per_token` of their mean visible context ``int(prefix + (tokens + 1) / 2)``;
    not the lm_head (:func:`lm_head_flops`, per sampled row)."""
    return tokens * analytic_flops_per_token(config, int(prefix + (tokens + 1) / 2))


def lm_head_flops(config: Qwen35MoeConfig) -> float:
    """Matmul flops of one row's logits: ``2 * hidden * vocab``."""
    return 2.0 * config.hidden_size * config.vocab_size


def expert_pair_flops(config: Qwen35MoeConfig) -> float:
    """One (token, routed expert) pair in one layer: gate, up and down projections."""
    return 6.0 * config.hidden_size * config.moe_intermediate_size
