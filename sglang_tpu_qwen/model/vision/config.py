"""Vision-tower configuration of the Qwen3.5 family, parsed from ``config.json``'s ``vision_config``.

Field names follow HF ``Qwen3_5VisionConfig`` / ``Qwen3_5MoeVisionConfig`` (transformers ``models/qwen3_5``,
``models/qwen3_5_moe``); the defaults are HF's, which are the released checkpoints' values (depth 27, width
1152, 16-pixel patches, temporal patch 2, a 48 x 48 learned position grid, a 2 x 2 spatial merge).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

# model_types whose config.json nests a vision tower under "vision_config".
_VL_MODEL_TYPES = ("qwen3_5", "qwen3_5_moe")
# HF ACT2FN names the tower's MLP may use -> jax.nn spelling (gelu_pytorch_tanh is the released value).
ACTIVATIONS = ("gelu_pytorch_tanh", "gelu", "gelu_new", "silu")


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    """Hyper-parameters of a Qwen3.5 vision tower (hashable: a jit static arg).

    ``head_dim = hidden_size // num_heads``; a patch row of ``pixel_values`` has ``patch_dim = in_channels *
    temporal_patch_size * patch_size**2`` values; the learned position table is a square grid of
    ``grid_side**2 = num_position_embeddings`` rows; ``out_hidden_size`` is the text model's hidden size.
    """

    depth: int = 27
    hidden_size: int = 1152
    hidden_act: str = "gelu_pytorch_tanh"
    intermediate_size: int = 4304
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 16
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    out_hidden_size: int = 3584
    num_position_embeddings: int = 2304
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size * self.patch_size

    @property
    def grid_side(self) -> int:
        return math.isqrt(self.num_position_embeddings)

    @property
    def merge_unit(self) -> int:
        """Patches per text-model token (``spatial_merge_size ** 2``)."""
        return self.spatial_merge_size * self.spatial_merge_size

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> VisionConfig:
        """Parse a ``vision_config`` dict (missing fields take HF's defaults).

        Raises:
            ValueError: an unsupported activation or rope type, a width not divisible by the heads, a head
                dim not divisible by 4 (the 2-D rotary splits it in four), or a non-square position table.
        """
        defaults = cls()

        def get(name: str) -> Any:
            v = d.get(name)
            return getattr(defaults, name) if v is None else v

        def one(name: str) -> int:  # HF allows [t, p, p]-style lists; the released configs use one int
            v = get(name)
            if isinstance(v, (list, tuple)):
                if len(set(v)) != 1:
                    raise ValueError(f"vision_config.{name} {v!r}: only equal sizes are supported")
                v = v[0]
            return int(v)

        rope = d.get("rope_parameters") or {}
        if rope.get("rope_type", "axial") != "axial":
            raise ValueError(f"vision_config rope_type {rope.get('rope_type')!r}: only 'axial' is implemented")
        cfg = cls(
            depth=int(get("depth")), hidden_size=int(get("hidden_size")), hidden_act=str(get("hidden_act")),
            intermediate_size=int(get("intermediate_size")), num_heads=int(get("num_heads")),
            in_channels=int(get("in_channels")), patch_size=one("patch_size"),
            spatial_merge_size=int(get("spatial_merge_size")), temporal_patch_size=one("temporal_patch_size"),
            out_hidden_size=int(get("out_hidden_size")), num_position_embeddings=int(get("num_position_embeddings")),
            rope_theta=float(rope.get("rope_theta", 10000.0)),
        )  # fmt: skip
        if cfg.hidden_act not in ACTIVATIONS:
            raise ValueError(f"vision_config.hidden_act {cfg.hidden_act!r}: expected one of {ACTIVATIONS}")
        if cfg.hidden_size % cfg.num_heads or cfg.head_dim % 4:
            raise ValueError(f"vision_config: hidden_size {cfg.hidden_size} over {cfg.num_heads} heads must give a "
                             "head dim divisible by 4")
        if cfg.grid_side**2 != cfg.num_position_embeddings:
            raise ValueError(f"vision_config.num_position_embeddings {cfg.num_position_embeddings} is not a square")
        return cfg


def load_vision_config(model_dir: str | os.PathLike[str]) -> VisionConfig | None:
    """The vision tower of ``<model_dir>/config.json``, or None for a text-only checkpoint (no
    ``vision_config``, or a flat ``*_text`` / ``qwen3_next`` model type).

    Raises:
        FileNotFoundError: no config.json. ValueError: as :meth:`VisionConfig.from_hf_dict`.
    """
    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
        d = json.load(f)
    if d.get("model_type") not in _VL_MODEL_TYPES or not isinstance(d.get("vision_config"), dict):
        return None
    return VisionConfig.from_hf_dict(d["vision_config"])
