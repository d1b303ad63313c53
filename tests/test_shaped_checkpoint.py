"""The 35B-shaped random checkpoint (embedded/shaped_35b.py): its config's sizes, and a small build through the
same code path that the project's loader and the Engine accept."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from conftest import ENGINE_KWARGS

from sglang_tpu_qwen.embedded import shaped_35b
from sglang_tpu_qwen.embedded.checkpoint import _init_leaf
from sglang_tpu_qwen.model.config import Qwen35MoeConfig, load_config
from sglang_tpu_qwen.model.param_layout import INDEX_FILE, param_specs
from sglang_tpu_qwen.model.weights import load_params

_FULL_CONFIG = shaped_35b.shaped_35b_config_dict  # the fixture swaps the module's for small_config_dict
SHARD_BYTES = 20 * 2**20  # several shards at the small sizes (the two [vocab, 64] matrices are 32 MB each)


def small_config_dict() -> dict[str, Any]:
    """The 35B-shaped config with every width cut down (same layer schedule, vocabulary and MTP layer)."""
    config = _FULL_CONFIG()
    text = dict(config["text_config"])
    text.update(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=64, linear_num_key_heads=2,
                linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32, num_experts=8,
                num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                max_position_embeddings=4096,
                rope_parameters={**text["rope_parameters"], "mrope_section": [3, 3, 2]})
    return {**config, "text_config": text}


@pytest.fixture(scope="module")
def small_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The small variant, built by the CLI (config swapped in) into a fresh cache root."""
    root = tmp_path_factory.mktemp("shaped")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(shaped_35b, "shaped_35b_config_dict", small_config_dict)
        mp.setattr(shaped_35b, "DEFAULT_SHARD_BYTES", SHARD_BYTES)
        first = shaped_35b.main(["--out", str(root)])
        stamp = (first / INDEX_FILE).stat().st_mtime_ns
        assert shaped_35b.main(["--out", str(root)]) == first  # cached: nothing rebuilt
        assert (first / INDEX_FILE).stat().st_mtime_ns == stamp
    return first


def test_35b_config_has_the_stated_sizes() -> None:
    d = shaped_35b.shaped_35b_config_dict()
    assert d["model_type"] == "qwen3_5_moe" and d["architectures"] == ["Qwen3_5MoeForConditionalGeneration"]
    c = Qwen35MoeConfig.from_hf_dict(d)
    assert (c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (2048, 16, 2, 256)
    assert (c.linear_num_key_heads, c.linear_num_value_heads) == (16, 32)
    assert (c.linear_key_head_dim, c.linear_value_head_dim) == (128, 128)
    assert c.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    assert (c.num_experts, c.num_experts_per_tok) == (128, 8)
    assert (c.moe_intermediate_size, c.shared_expert_intermediate_size) == (512, 512)
    assert (c.vocab_size, c.tie_word_embeddings, c.mtp_num_hidden_layers) == (248320, False, 1)
    assert c.rotary_dim == 64 and sum(c.mrope_section or ()) == c.rotary_dim // 2
    assert c.max_position_embeddings == 32768  # the page table of the default context fits the v5e SMEM
    # Bytes from the shapes alone: the table the builder writes equals the parameter specs (MTP layer included).
    specs = jax.tree.leaves(param_specs(c, stacked=False, mtp=True))
    spec_bytes = sum(math.prod(s.shape) * s.dtype.itemsize for s in specs)
    assert shaped_35b.checkpoint_nbytes(d) == spec_bytes
    assert 6.3e9 < spec_bytes < 6.5e9  # ~6.4 GB of bf16 (A_log float32): fits a 15.75 GiB v5e with room to serve


def test_small_build_writes_a_sharded_hf_checkpoint(small_checkpoint: Path) -> None:
    index = json.loads((small_checkpoint / INDEX_FILE).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and shards == sorted(p.name for p in small_checkpoint.glob("model-*.safetensors"))
    assert index["metadata"]["total_size"] == shaped_35b.checkpoint_nbytes(small_config_dict())
    assert any(name.startswith("mtp.layers.0.mlp.experts.7.") for name in index["weight_map"])
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (small_checkpoint / f).is_file(), f
    assert json.loads((small_checkpoint / "config.json").read_text()) == small_config_dict()


def test_small_build_loads_with_the_embedded_models_scales(small_checkpoint: Path) -> None:
    config = load_config(small_checkpoint)
    params = load_params(small_checkpoint, config, stacked=False, mtp=True)  # every tensor present and shaped
    assert "mtp" in params
    embed = np.asarray(params["embed"], np.float32)
    assert not embed[248077:].any() and not np.asarray(params["lm_head"], np.float32)[248077:].any()
    # Each leaf's spread matches the embedded model's initialisation (numpy, same rules) within sampling noise: the
    # rules differ by factors of 1.4 or more (fan-in vs 2/sqrt(H), 0.1 vs 0.3), far outside it.
    checked = 0
    for path, x in jax.tree_util.tree_flatten_with_path({k: v for k, v in params.items() if k != "mtp"})[0]:
        name = "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
        ours = np.asarray(x, np.float32)
        if ours.size < 256:
            continue
        ref = _init_leaf(name, ours.shape, config.hidden_size)
        if name in ("embed", "lm_head"):
            ours, ref = ours[:248077], ref[:248077]
        tol = 4.5 / math.sqrt(ours.size)  # ~4.5 sigma of two independent samples' std (relative) and mean
        assert abs(ours.std() / ref.std() - 1) < tol, name
        assert abs(ours.mean() - ref.mean()) < tol * math.sqrt(2) * ref.std(), name
        checked += 1
    assert checked > 30
    for layer in config.gdn_layer_ids:  # GDN decay: A = U(1, 16), dt = softplus(dt_bias) in [1e-3, 0.1]
        gdn = params["layers"][layer]["gdn"]
        a = np.exp(np.asarray(gdn["A_log"], np.float64))
        dt = np.log1p(np.exp(np.asarray(gdn["dt_bias"], np.float64)))
        assert ((a > 0.99) & (a < 16.1)).all() and ((dt > 0.9e-3) & (dt < 0.11)).all()
        assert abs(float(np.asarray(gdn["norm"], np.float32).mean()) - 1) < 0.1  # gated norm: x * w, w near 1
    mtp = params["mtp"]
    assert abs(float(np.asarray(mtp["fc"], np.float32).std()) * math.sqrt(2 * config.hidden_size) - 1) < 0.1
    assert float(np.abs(np.asarray(mtp["norm"], np.float32)).mean()) < 0.2  # applied as x * (1 + w): near 0


def test_engine_serves_the_small_build(small_checkpoint: Path) -> None:
    from sglang_tpu_qwen.engine.engine import Engine

    engine = Engine(model_path=str(small_checkpoint), **ENGINE_KWARGS)
    try:
        params = {"temperature": 0, "max_new_tokens": 6}
        first = engine.generate("The capital city of France is", params)
        again = engine.generate("The capital city of France is", params)
    finally:
        engine.shutdown()
    assert first["meta_info"]["finish_reason"]["type"] == "length"
    assert len(first["output_ids"]) == 6
    assert again["output_ids"] == first["output_ids"]
