"""Tiny Qwen3.5 vision-language checkpoints built with transformers' own classes, shared by the image tests.

``build_vl_checkpoint(root, kind)`` writes a randomised ``Qwen3_5MoeForConditionalGeneration`` (``kind="moe"``)
or ``Qwen3_5ForConditionalGeneration`` (``kind="dense"``) in bfloat16 with its ``preprocessor_config.json``, and
returns the HF model re-read in float32 (the oracle) and the directory. The text model has the release's vocabulary
and special-token ids, so the server's Qwen tokenizer and chat template apply unchanged; the vision tower has odd
sizes (3 heads of 16, 2 blocks, a 7x7 learned position grid that every image resamples, 4-pixel patches).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import transformers

VOCAB = 248320  # the release's vocabulary: the Qwen tokenizer's ids (image pad 248056) are valid rows
TEXT = dict(
    vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4,
    layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
    num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                     "mrope_section": [3, 3, 2], "mrope_interleaved": True},
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
    rms_norm_eps=1e-6, max_position_embeddings=4096, eos_token_id=248046, pad_token_id=248044,
)  # fmt: skip
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
VISION = dict(depth=2, hidden_size=48, intermediate_size=72, num_heads=3, out_hidden_size=64, patch_size=4,
              spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=49)
# What Qwen3.5's released preprocessor_config.json holds, scaled to 4-pixel patches: an image is resized so each
# side is a multiple of patch * merge = 8 pixels and its area lies in [min, max] pixels.
PREPROCESSOR = {
    "image_processor_type": "Qwen2VLImageProcessor",
    "processor_class": "Qwen3VLProcessor",
    "patch_size": 4, "merge_size": 2, "temporal_patch_size": 2,
    "size": {"shortest_edge": 8 * 8, "longest_edge": 64 * 64},
    "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
    "do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
    "do_convert_rgb": True,
}  # fmt: skip


def _randomise(model: Any, seed: int) -> None:
    """Non-trivial weights: HF's init leaves norms at 1 and some projections at 0, which hides bugs."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.log(torch.empty_like(p).uniform_(1.0, 16.0, generator=gen)))
            elif "norm" in name and p.dim() == 1:
                p.add_(0.1 * torch.randn(p.shape, generator=gen))
            elif p.dim() >= 2 or name.endswith("bias"):
                fan_in = p.shape[-1] if p.dim() >= 2 else 1
                scale = 1.0 if "embed" in name else fan_in**-0.5
                p.copy_(scale * torch.randn(p.shape, generator=gen))


def build_vl_checkpoint(root: Path, kind: str = "moe", seed: int = 0) -> tuple[Any, Path]:
    """Write a tiny VL checkpoint of ``kind`` ("moe" or "dense") under ``root`` and return (HF oracle in float32,
    its directory). The checkpoint is stored in bfloat16, as released; the oracle reads those bytes."""
    torch.manual_seed(seed)
    if kind == "moe":
        config = transformers.Qwen3_5MoeConfig(text_config=dict(TEXT, **MOE), vision_config=VISION,
                                               tie_word_embeddings=False)
        model = transformers.Qwen3_5MoeForConditionalGeneration(config)
    elif kind == "dense":
        config = transformers.Qwen3_5Config(text_config=dict(TEXT, intermediate_size=96), vision_config=VISION,
                                            tie_word_embeddings=False)
        model = transformers.Qwen3_5ForConditionalGeneration(config)
    else:
        raise ValueError(f"kind must be 'moe' or 'dense', got {kind!r}")
    model.eval()
    _randomise(model, seed=seed + 11)
    path = Path(root) / f"vl-{kind}"
    model.to(torch.bfloat16).save_pretrained(path)
    (path / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR, indent=1))
    oracle = type(model).from_pretrained(path, dtype=torch.float32).eval()
    return oracle, path


def image_processor(path: Path) -> Any:
    """transformers' image processor of the checkpoint at ``path`` (the preprocessing oracle)."""
    return transformers.AutoImageProcessor.from_pretrained(path)
