"""Qwen3.5-MoE text-model configuration, parsed from a HF ``config.json``.

Field names follow HF ``Qwen3_5MoeTextConfig`` (transformers
``models/qwen3_5_moe/configuration_qwen3_5_moe.py``).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

_SUPPORTED_MODEL_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text")
_LAYER_KINDS = ("linear_attention", "full_attention")


@dataclasses.dataclass(frozen=True)
class Qwen35MoeConfig:
    """Hyper-parameters of the Qwen3.5-MoE text decoder (hashable: usable as a jit static arg)."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    rope_theta: float
    partial_rotary_factor: float
    rotary_dim: int
    mrope_section: tuple[int, ...] | None
    mrope_interleaved: bool
    layer_types: tuple[str, ...]
    linear_conv_kernel_dim: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    norm_topk_prob: bool = True
    hidden_act: str = "silu"
    eos_token_id: tuple[int, ...] = ()
    torch_dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries, num_hidden_layers is {self.num_hidden_layers}"
            )
        bad = [t for t in self.layer_types if t not in _LAYER_KINDS]
        if bad:
            raise ValueError(f"unsupported layer type(s) {sorted(set(bad))}; expected one of {_LAYER_KINDS}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError("linear_num_value_heads must be a multiple of linear_num_key_heads")
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise ValueError(f"rotary_dim {self.rotary_dim} must be even and in (0, head_dim]")
        if self.hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {self.hidden_act!r}; only 'silu'")

    # ---- derived ----
    @property
    def attn_layer_ids(self) -> tuple[int, ...]:
        """Indices (into ``layer_types``) of the full-attention layers."""
        return tuple(i for i, t in enumerate(self.layer_types) if t == "full_attention")

    @property
    def gdn_layer_ids(self) -> tuple[int, ...]:
        """Indices (into ``layer_types``) of the Gated DeltaNet (linear-attention) layers."""
        return tuple(i for i, t in enumerate(self.layer_types) if t == "linear_attention")

    @property
    def num_attn_layers(self) -> int:
        """Number of full-attention layers (the leading dim of the KV cache)."""
        return len(self.attn_layer_ids)

    @property
    def num_gdn_layers(self) -> int:
        """Number of Gated DeltaNet layers (the leading dim of the GDN state cache)."""
        return len(self.gdn_layer_ids)

    @property
    def gdn_key_dim(self) -> int:
        """Hk * dk: width of the q (and of the k) part of ``in_proj_qkv``."""
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def gdn_value_dim(self) -> int:
        """Hv * dv: width of the v part of ``in_proj_qkv`` and of ``in_proj_z``."""
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def gdn_conv_dim(self) -> int:
        """Channels of the causal conv1d: 2 * Hk * dk + Hv * dv."""
        return 2 * self.gdn_key_dim + self.gdn_value_dim

    # ---- construction ----
    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> Qwen35MoeConfig:
        """Build from a HF config dict (``qwen3_5_moe`` with ``text_config``, or flat ``qwen3_5_moe_text``).

        Raises:
            ValueError: unsupported ``model_type``, missing required field, or a ``rope_type`` other
                than ``default``.
        """
        model_type = d.get("model_type")
        if model_type not in _SUPPORTED_MODEL_TYPES:
            raise ValueError(f"unsupported model_type {model_type!r}; expected one of {_SUPPORTED_MODEL_TYPES}")
        if model_type == "qwen3_5_moe":
            if not isinstance(d.get("text_config"), dict):
                raise ValueError("qwen3_5_moe config has no 'text_config' dict")
            outer = d
            t = d["text_config"]
        else:
            outer = {}
            t = d

        def get(name: str, default: Any = None, *, required: bool = False) -> Any:
            if name in t and t[name] is not None:
                return t[name]
            if name in outer and outer[name] is not None:
                return outer[name]
            if required:
                raise ValueError(f"config is missing required field {name!r}")
            return default

        rope = t.get("rope_parameters") or t.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"unsupported rope_type {rope_type!r}; only 'default' RoPE is implemented")
        rope_theta = float(rope.get("rope_theta", get("rope_theta", 10000.0)))
        partial = float(rope.get("partial_rotary_factor", get("partial_rotary_factor", 0.25)))
        mrope_section = rope.get("mrope_section", get("mrope_section"))
        mrope_interleaved = bool(rope.get("mrope_interleaved", get("mrope_interleaved", False)))

        num_layers = int(get("num_hidden_layers", required=True))
        layer_types = get("layer_types")
        if layer_types is None:
            interval = int(get("full_attention_interval", 4))
            layer_types = [
                "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers)
            ]

        eos = get("eos_token_id")
        if eos is None:
            eos_ids: tuple[int, ...] = ()
        elif isinstance(eos, int):
            eos_ids = (eos,)
        else:
            eos_ids = tuple(int(e) for e in eos)

        head_dim = int(get("head_dim", required=True))
        return cls(
            vocab_size=int(get("vocab_size", required=True)),
            hidden_size=int(get("hidden_size", required=True)),
            num_hidden_layers=num_layers,
            num_attention_heads=int(get("num_attention_heads", required=True)),
            num_key_value_heads=int(get("num_key_value_heads", required=True)),
            head_dim=head_dim,
            rms_norm_eps=float(get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(get("tie_word_embeddings", False)),
            max_position_embeddings=int(get("max_position_embeddings", 32768)),
            rope_theta=rope_theta,
            partial_rotary_factor=partial,
            rotary_dim=int(head_dim * partial),
            mrope_section=tuple(int(s) for s in mrope_section) if mrope_section is not None else None,
            mrope_interleaved=mrope_interleaved,
            layer_types=tuple(str(x) for x in layer_types),
            linear_conv_kernel_dim=int(get("linear_conv_kernel_dim", 4)),
            linear_key_head_dim=int(get("linear_key_head_dim", 128)),
            linear_value_head_dim=int(get("linear_value_head_dim", 128)),
            linear_num_key_heads=int(get("linear_num_key_heads", 16)),
            linear_num_value_heads=int(get("linear_num_value_heads", 32)),
            num_experts=int(get("num_experts", required=True)),
            num_experts_per_tok=int(get("num_experts_per_tok", required=True)),
            moe_intermediate_size=int(get("moe_intermediate_size", required=True)),
            shared_expert_intermediate_size=int(get("shared_expert_intermediate_size", required=True)),
            norm_topk_prob=bool(get("norm_topk_prob", True)),
            hidden_act=str(get("hidden_act", "silu")),
            eos_token_id=eos_ids,
            torch_dtype=str(get("torch_dtype", get("dtype", "bfloat16"))),
        )


def load_config(model_dir: str | os.PathLike[str]) -> Qwen35MoeConfig:
    """Read ``<model_dir>/config.json`` and parse it with :meth:`Qwen35MoeConfig.from_hf_dict`.

    Raises:
        FileNotFoundError: no config.json in ``model_dir``.
        ValueError: see ``from_hf_dict``.
    """
    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
        return Qwen35MoeConfig.from_hf_dict(json.load(f))
