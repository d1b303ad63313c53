"""The held-out benchmark checkpoint of issue 12: a random Qwen3.5-MoE of hidden 96, 6 layers, 12 experts
top-3 and the real 248320-row vocabulary.

Built like the embedded model (same initialisation, same files and tokenizer; embedded/checkpoint.py) but with
other sizes, so a benchmark on it is not tuned to the default checkpoint. Layers follow the release's
pattern (three Gated DeltaNet layers, then one attention layer): linear x3, full, linear x2.

Usage: ``python -m sglang_tpu_qwen.bench.heldout_model`` prints the directory (built once, cached).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from sglang_tpu_qwen.embedded import checkpoint as embedded

MODEL_DIRNAME = "Qwen3.5-Heldout-H96-L6-E12"


def heldout_config_dict() -> dict[str, Any]:
    """HF config.json: the embedded model's with hidden 96, 6 layers, 12 experts, top-3."""
    config = embedded.embedded_config_dict()
    text = dict(config["text_config"])
    text.update(hidden_size=96, num_hidden_layers=6, num_experts=12, num_experts_per_tok=3,
                layer_types=["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 2)
    return {**config, "text_config": text}


def ensure_heldout_model(cache_root: Path | None = None) -> Path:
    """Directory of the held-out checkpoint under the embedded model's cache root, built on first use
    (embedded.build_once)."""
    config_dict = heldout_config_dict()
    digest = hashlib.sha256(json.dumps(config_dict, sort_keys=True).encode())
    digest.update(Path(embedded.__file__).read_bytes())
    root = cache_root or embedded.default_cache_root()
    return embedded.build_once(root / f"heldout-{digest.hexdigest()[:12]}", MODEL_DIRNAME,
                               lambda out: embedded.build_embedded_model(out, config_dict))


if __name__ == "__main__":
    print(ensure_heldout_model())
