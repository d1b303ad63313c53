"""Text-model configuration of the Qwen3.5 family and Qwen3-Next, parsed from a HF ``config.json``.

Field names follow HF ``Qwen3_5MoeTextConfig`` / ``Qwen3_5TextConfig`` / ``Qwen3NextConfig`` (transformers
``models/qwen3_5_moe``, ``models/qwen3_5``, ``models/qwen3_next``). One decoder serves them all: the
same hybrid layer schedule, with a sparse MoE block or a dense SwiGLU MLP after each mixer
(``mlp_types``). Qwen3-Next differs only in its checkpoint layout (fused ``in_proj_qkvz`` /
``in_proj_ba``, ``gdn_fused_projections``) and its per-layer MoE choice (``decoder_sparse_step``,
``mlp_only_layers``).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

# model_type -> (nested under text_config, MoE family). Qwen3-Next is flat, MoE by default.
_MODEL_TYPES = {
    "qwen3_5_moe": (True, True), "qwen3_5_moe_text": (False, True),
    "qwen3_5": (True, False), "qwen3_5_text": (False, False),
    "qwen3_next": (False, True),
}  # fmt: skip
_SUPPORTED_MODEL_TYPES = tuple(_MODEL_TYPES)
_LAYER_KINDS = ("linear_attention", "full_attention")
_MLP_KINDS = ("moe", "dense")


@dataclasses.dataclass(frozen=True)
class Qwen35MoeConfig:
    """Hyper-parameters of a Qwen3.5 (MoE or dense) or Qwen3-Next text decoder (hashable: usable as a jit
    static arg).

    ``mlp_types[i]`` is ``"moe"`` (routed experts + gated shared expert: ``num_experts`` ...) or ``"dense"``
    (SwiGLU of width ``intermediate_size``) for layer ``i``; the MoE fields are 0 for a dense model.
    """

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
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    intermediate_size: int = 0
    mlp_types: tuple[str, ...] = ()
    gdn_fused_projections: bool = False
    norm_topk_prob: bool = True
    hidden_act: str = "silu"
    eos_token_id: tuple[int, ...] = ()
    torch_dtype: str = "bfloat16"
    # The checkpoint's precision for the GDN state (Qwen3.5 configs say "float32"); --mamba-ssm-dtype overrides.
    mamba_ssm_dtype: str = "float32"
    # Multi-token-prediction layers the release ships (``mtp.*``; every Qwen3.5 has one). Loaded only for
    # speculative decoding (model/mtp.py); not compared: the target model is the same with or without them.
    mtp_num_hidden_layers: int = dataclasses.field(default=0, compare=False)
    # Vision-language checkpoints (a ``vision_config`` beside ``text_config``): the image pad token, the vision
    # start token and the vision tower's spatial merge (M-RoPE positions, model/mrope.py). None when text-only.
    # Not compared: they describe the image input, and the text model of a VL config equals its flat twin's.
    image_token_id: int | None = dataclasses.field(default=None, compare=False)
    vision_start_token_id: int | None = dataclasses.field(default=None, compare=False)
    spatial_merge_size: int = dataclasses.field(default=1, compare=False)

    @property
    def has_vision(self) -> bool:
        """The checkpoint takes images: its steps place image embeddings and use 3-D M-RoPE positions."""
        return self.image_token_id is not None

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
        if not self.mlp_types:  # the MoE family's default: a sparse block in every layer
            object.__setattr__(self, "mlp_types", ("moe",) * self.num_hidden_layers)
        if len(self.mlp_types) != self.num_hidden_layers or set(self.mlp_types) - set(_MLP_KINDS):
            raise ValueError(f"mlp_types must give one of {_MLP_KINDS} per layer, got {self.mlp_types}")
        if "moe" in self.mlp_types and not (
            self.num_experts > 0 and 0 < self.num_experts_per_tok <= self.num_experts and self.moe_intermediate_size > 0
        ):
            raise ValueError("a MoE layer needs num_experts, num_experts_per_tok <= num_experts and "
                             "moe_intermediate_size > 0")
        if "dense" in self.mlp_types and self.intermediate_size <= 0:
            raise ValueError("a dense MLP layer needs intermediate_size > 0")

    # ---- derived ----
    @property
    def mtp_mlp_type(self) -> str:
        """The MLP kind of the MTP decoder layer: ``moe`` in the MoE family (SGLang / vLLM ``qwen3_5_mtp``),
        ``dense`` in the dense one."""
        return "moe" if self.is_moe else "dense"

    @property
    def is_moe(self) -> bool:
        """True when some layer has a sparse MoE block (then expert parallelism has experts to split)."""
        return "moe" in self.mlp_types

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
        """Build from a HF config dict: ``qwen3_5_moe`` / ``qwen3_5`` with ``text_config``, or flat
        ``qwen3_5_moe_text`` / ``qwen3_5_text`` / ``qwen3_next``.

        Raises:
            ValueError: unsupported ``model_type``, missing required field, or a ``rope_type`` other
                than ``default``.
        """
        model_type = d.get("model_type")
        if model_type not in _MODEL_TYPES:
            raise ValueError(f"unsupported model_type {model_type!r}; expected one of {_SUPPORTED_MODEL_TYPES}")
        nested, moe_family = _MODEL_TYPES[model_type]
        if nested:
            if not isinstance(d.get("text_config"), dict):
                raise ValueError(f"{model_type} config has no 'text_config' dict")
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
        if not moe_family:
            mlp_types = ["dense"] * num_layers
        elif model_type == "qwen3_next":  # HF Qwen3NextDecoderLayer: MoE unless listed or off the sparse step
            only, step = set(get("mlp_only_layers") or ()), int(get("decoder_sparse_step", 1))
            experts = int(get("num_experts", 0))
            mlp_types = ["moe" if i not in only and experts > 0 and (i + 1) % step == 0 else "dense"
                         for i in range(num_layers)]
        else:
            mlp_types = ["moe"] * num_layers
        moe = "moe" in mlp_types
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
            num_experts=int(get("num_experts", required=moe)) if moe else 0,
            num_experts_per_tok=int(get("num_experts_per_tok", required=moe)) if moe else 0,
            moe_intermediate_size=int(get("moe_intermediate_size", required=moe)) if moe else 0,
            shared_expert_intermediate_size=int(get("shared_expert_intermediate_size", required=moe)) if moe else 0,
            intermediate_size=int(get("intermediate_size", required=True)) if "dense" in mlp_types else 0,
            mlp_types=tuple(mlp_types),
            gdn_fused_projections=model_type == "qwen3_next",
            norm_topk_prob=bool(get("norm_topk_prob", True)),
            hidden_act=str(get("hidden_act", "silu")),
            eos_token_id=eos_ids,
            torch_dtype=str(get("torch_dtype", get("dtype", "bfloat16"))),
            mamba_ssm_dtype=str(get("mamba_ssm_dtype", "float32")),
            mtp_num_hidden_layers=int(get("mtp_num_hidden_layers", get("num_nextn_predict_layers", 0)) or 0),
            **_vision_fields(outer),
        )


def _vision_fields(outer: dict[str, Any]) -> dict[str, Any]:
    """image_token_id / vision_start_token_id / spatial_merge_size of a VL config (HF
    ``Qwen3_5MoeConfig``: top level beside ``vision_config``); none for a text-only one."""
    vision = outer.get("vision_config")
    if not isinstance(vision, dict) or outer.get("image_token_id") is None:
        return {}
    return dict(image_token_id=int(outer["image_token_id"]),
                vision_start_token_id=int(outer.get("vision_start_token_id", -1)),
                spatial_merge_size=int(vision.get("spatial_merge_size", 2)))


def load_config(model_dir: str | os.PathLike[str]) -> Qwen35MoeConfig:
    """Read ``<model_dir>/config.json`` and parse it with :meth:`Qwen35MoeConfig.from_hf_dict`.

    Raises:
        FileNotFoundError: no config.json in ``model_dir``.
        ValueError: see ``from_hf_dict``.
    """
    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
        return Qwen35MoeConfig.from_hf_dict(json.load(f))
