"""The JAX vision tower against HF's (``model.model.visual(pixel_values, grid_thw).pooler_output``), its loader,
and the serving wrapper (VisionEncoder: buckets, precompile, encoder cache, memory).

Tolerances (max |ours - HF| over the output, relative to max |HF|): float32 against HF in float32: 1e-5
(measured ~3e-7); bfloat16 against HF's tower run in bfloat16, and against the float32 oracle: 2e-2 (measured
~7e-3 and ~4e-3: one bfloat16 ulp at the output's scale).
"""

from __future__ import annotations

import copy
import functools
import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from PIL import Image
from safetensors import safe_open
from safetensors.numpy import save_file
from transformers import vision_utils
from vl_checkpoint import image_processor

from sglang_tpu_qwen.engine.io.multimodal import ImageItem, content_hash
from sglang_tpu_qwen.engine.runner import compilation
from sglang_tpu_qwen.engine.runner.vision_encoder import VisionEncoder, patch_buckets
from sglang_tpu_qwen.model.safetensors_file import CheckpointError
from sglang_tpu_qwen.model.vision.config import VisionConfig, load_vision_config
from sglang_tpu_qwen.model.vision.grid import tower_inputs
from sglang_tpu_qwen.model.vision.tower import vision_tower
from sglang_tpu_qwen.model.vision.weights import load_vision_params
from sglang_tpu_qwen.quant import fp8_blocks
from sglang_tpu_qwen.quant.fp8 import Fp8Weight

TOL = {"float32": 1e-5, "bfloat16": 2e-2}
MAX_PATCHES = 256  # the test preprocessor's largest image (64 * 64 pixels of 4 x 4 patches)


def _images(path: Path, sizes: list[tuple[int, int]], seed: int) -> list[ImageItem]:
    """Random RGB images of (height, width) pixels, preprocessed by the checkpoint's HF image processor."""
    rng = np.random.default_rng(seed)
    proc = image_processor(path)
    items = []
    for h, w in sizes:
        pixels = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        out = proc(images=[Image.fromarray(pixels)], return_tensors="np")
        items.append(ImageItem(grid_thw=tuple(int(x) for x in out["image_grid_thw"][0]),
                               content_hash=content_hash(pixels), pixel_values=out["pixel_values"].astype(np.float32),
                               merge_size=2))
    return items


def _hf(visual: Any, items: list[ImageItem], dtype: torch.dtype) -> np.ndarray:
    pv = torch.from_numpy(np.concatenate([i.pixel_values for i in items])).to(dtype)
    thw = torch.tensor([i.grid_thw for i in items])
    with torch.no_grad():
        return visual(pv, thw).pooler_output.float().numpy()


@functools.cache
def _encoder(path: Path, dtype: str) -> VisionEncoder:
    enc = VisionEncoder.from_checkpoint(str(path), jnp.dtype(dtype), max_patches=MAX_PATCHES)
    assert enc is not None
    return enc


def _rel_err(ours: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


@pytest.mark.parametrize("kind", ["moe", "dense"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tower_matches_hf(kind: str, dtype: str, vl_checkpoint: Any) -> None:
    """One image, then two images of different sizes in one call (padded into one bucket), against HF."""
    oracle, path = vl_checkpoint(kind)
    enc = _encoder(path, dtype)
    visual = oracle.model.visual if dtype == "float32" else copy.deepcopy(oracle.model.visual).to(torch.bfloat16)
    one = _images(path, [(40, 56)], seed=1)
    two = _images(path, [(24, 32), (56, 40)], seed=2)
    calls = enc.stats.calls
    for items in (one, two):
        got = enc.encode(items)
        assert [g.shape for g in got] == [(i.num_tokens, 64) for i in items]
        assert all(g.dtype == jnp.dtype(dtype) for g in got)
        ours = np.concatenate([np.asarray(g.astype(jnp.float32)) for g in got])
        assert _rel_err(ours, _hf(visual, items, visual.dtype)) < TOL[dtype]
        if dtype == "bfloat16":  # and not far from the float32 oracle either
            assert _rel_err(ours, _hf(oracle.model.visual, items, torch.float32)) < TOL[dtype]
    assert enc.stats.calls == calls + 2  # the two images of different sizes ran in one call


def test_encoder_cache(vl_checkpoint: Any) -> None:
    """A repeated image returns the cached array without running the tower; a duplicate within a call runs once;
    the byte cap evicts the least recently used."""
    _, path = vl_checkpoint("moe")
    enc = _encoder(path, "float32")
    a, b, c = _images(path, [(32, 32)] * 3, seed=3)  # 16 tokens each, different pixels
    first = enc.encode([a, a])
    assert first[0] is first[1]
    calls, encoded = enc.stats.calls, enc.stats.encoded
    again = enc.encode([a])
    assert again[0] is first[0] and enc.stats.calls == calls and enc.stats.encoded == encoded
    # A cap that holds two of these embeddings.
    small = VisionEncoder(enc.config, enc.params, sharding=enc.sharding, buckets=enc.buckets,
                          cache_bytes=2 * 16 * 64 * 4)
    small._compiled = enc._compiled  # the same programs; nothing to compile again
    ea = small.encode([a])[0]
    small.encode([b])
    assert small.encode([a])[0] is ea  # a hit refreshes a
    small.encode([c])  # evicts b, the least recently used
    assert small.cached_bytes <= small.cache_bytes
    calls = small.stats.calls
    assert small.encode([a])[0] is ea and small.stats.calls == calls
    small.encode([b])
    assert small.stats.calls == calls + 1


def test_precompile_then_no_compilation(vl_checkpoint: Any) -> None:
    """After precompile(), encoding images of any allowed size compiles nothing; memory_bytes counts the weights,
    the cache cap and the largest bucket's temporaries."""
    compilation.install_counter()
    _, path = vl_checkpoint("moe")
    base = _encoder(path, "float32")
    enc = VisionEncoder(base.config, base.params, sharding=base.sharding, buckets=(64, 256), cache_bytes=1 << 20)
    assert patch_buckets(MAX_PATCHES) == (64, 128, 256)
    assert enc.precompile() == 2
    before = compilation.jit_compilations()
    calls = [_images(path, sizes, seed=10 + seed) for seed, sizes in enumerate([[(8, 8)], [(64, 64)],
                                                                                  [(24, 40), (16, 16), (8, 64)]])]
    for items in calls:
        assert [e.shape[0] for e in enc.encode(items)] == [i.num_tokens for i in items]
    assert compilation.jit_compilations() == before
    weights = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(enc.params))
    assert enc.memory_bytes() > weights + (1 << 20) + 256 * enc.config.patch_dim * 4
    with pytest.raises(ValueError, match="exceeds the encoder's largest bucket"):
        VisionEncoder(enc.config, enc.params, sharding=enc.sharding, buckets=(64,)).encode(calls[1])


@pytest.mark.parametrize("grids", [[(1, 10, 14)], [(1, 6, 8), (2, 4, 12), (1, 2, 2)], [(1, 16, 16)]])
def test_grid_arrays_match_hf(grids: list[tuple[int, int, int]]) -> None:
    """The host-side arrays equal transformers' vision_utils (bilinear taps, rotary positions, segments);
    a two-frame grid is two attention segments, as HF's cu_seqlens."""
    cfg = VisionConfig(num_position_embeddings=49, spatial_merge_size=2)
    thw = torch.tensor(grids)
    idx, w = vision_utils.get_vision_interpolation_indices_and_weights(
        thw, num_grid_per_side=7, mode="bilinear", align_corners=True, spatial_merge_size=2)
    ours = tower_inputs(grids, cfg, num_rows=int(thw.prod(-1).sum()) + 4)
    n = idx.shape[0]
    np.testing.assert_array_equal(ours.pos_index[:n], idx.numpy())
    np.testing.assert_array_equal(ours.pos_weight[:n], w.numpy())
    np.testing.assert_array_equal(ours.rope_hw[:n], vision_utils.get_vision_position_ids(thw, 2).numpy())
    cu = vision_utils.get_vision_cu_seqlens(thw).numpy()
    np.testing.assert_array_equal(ours.segment[:n], np.repeat(np.arange(len(cu) - 1), np.diff(cu)))
    assert (ours.pos_weight[n:] == 0).all() and len(set(ours.segment[n:])) == 1
    assert ours.segment[n] not in ours.segment[:n]


def _tower_copy(src: Path, dst: Path, edit: Any) -> None:
    """A checkpoint at ``dst`` holding ``src``'s config.json and only its tower tensors, after ``edit(tensors,
    config)`` (in place)."""
    dst.mkdir()
    cfg = json.loads((src / "config.json").read_text())
    with safe_open(src / "model.safetensors", "np") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys() if k.startswith("model.visual.")}
    edit(tensors, cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    save_file(tensors, dst / "model.safetensors")


def _quantise(block: tuple[int, int], out: dict[str, tuple[np.ndarray, np.ndarray]]) -> Any:
    """An edit making every tower linear weight block-FP8 (with ``_scale_inv``), recorded in ``out``."""
    def edit(tensors: dict[str, np.ndarray], cfg: dict[str, Any]) -> None:
        cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": list(block)}
        for name in list(tensors):
            if name.endswith("weight") and tensors[name].ndim == 2 and "pos_embed" not in name:
                q, s = fp8_blocks.quantize(tensors[name].astype(np.float32), block)
                tensors[name], tensors[name + "_scale_inv"] = q, s
                out[name] = (q, s)
    return edit


def test_loader_fp8_and_errors(tmp_path: Path, vl_checkpoint: Any) -> None:
    """Block-FP8 tower linears load dequantised or as Fp8Weight (same output); a missing tower tensor is a
    CheckpointError naming it; a text-only checkpoint has no tower."""
    _, path = vl_checkpoint("moe")
    cfg = load_vision_config(path)
    assert cfg is not None
    quantised: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    _tower_copy(path, tmp_path / "fp8", _quantise((16, 32), quantised))
    dense = load_vision_params(tmp_path / "fp8", cfg, jnp.float32)
    kept = load_vision_params(tmp_path / "fp8", cfg, jnp.float32, keep_fp8=True)
    q, s = quantised["model.visual.blocks.1.attn.qkv.weight"]
    np.testing.assert_array_equal(np.asarray(dense["blocks"]["qkv"]["w"][1]), fp8_blocks.dequantize(q, s, (16, 32)).T)
    assert isinstance(kept["blocks"]["qkv"]["w"], Fp8Weight) and kept["blocks"]["qkv"]["w"].block == (32, 16)
    items = _images(path, [(24, 40)], seed=5)
    inputs = tower_inputs([items[0].grid_thw], cfg)
    run = jax.jit(vision_tower, static_argnums=3)
    a, b = (np.asarray(run(p, items[0].pixel_values, inputs, cfg)) for p in (dense, kept))
    assert _rel_err(b, a) < TOL["float32"]

    broken = tmp_path / "broken"
    _tower_copy(path, broken, lambda tensors, _: tensors.pop("model.visual.blocks.0.attn.proj.bias"))
    with pytest.raises(CheckpointError, match="blocks.0.attn.proj.bias"):
        load_vision_params(broken, cfg, jnp.float32)

    text = tmp_path / "text"
    text.mkdir()
    hf = json.loads((path / "config.json").read_text())
    (text / "config.json").write_text(json.dumps(dict(hf["text_config"], model_type="qwen3_5_moe_text")))
    assert load_vision_config(text) is None and VisionEncoder.from_checkpoint(str(text), jnp.float32) is None


def test_attention_tiles_match_segments(monkeypatch: pytest.MonkeyPatch) -> None:
    """Query-row tiling (forced small here; large calls use it) gives per-segment softmax attention."""
    from sglang_tpu_qwen.model.vision import tower

    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((64, 3, 16)).astype(np.float32) for _ in range(3))
    segment = np.repeat([0, 1, 2], [24, 32, 8]).astype(np.int32)
    want = np.zeros_like(q)
    for s in range(3):
        rows = segment == s
        scores = np.einsum("qhd,khd->hqk", q[rows], k[rows]) / 4.0
        p = np.exp(scores - scores.max(-1, keepdims=True))
        want[rows] = np.einsum("hqk,khd->qhd", p / p.sum(-1, keepdims=True), v[rows])
    monkeypatch.setattr(tower, "SCORE_TILE_BYTES", 3 * 16 * 64 * 4)
    assert tower.tile_rows(64, 3) == 16
    got = jax.jit(lambda *a: tower._attention(*a))(q, k, v, segment)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def test_vl_engine_start(vl_engine: Any, vl_checkpoint: Any) -> None:
    """An Engine on a VL checkpoint: the encoder is built on the runner's device with the flags' cache and bucket
    sizes, precompiled before ready (images of every size afterwards compile nothing), its memory taken out of
    the budget and reported; the server's image preprocessor is bounded by its largest bucket."""
    from sglang_tpu_qwen.multimodal.image_inputs import ImageInputs

    _, path = vl_checkpoint("moe")
    runner = vl_engine.runner
    enc = runner.vision_encoder
    assert isinstance(enc, VisionEncoder) and enc.buckets == (64, 128, 256) and enc.cache_bytes == 1 << 20
    assert enc.dtype == runner.dtype and enc.sharding.device_set == runner.params["embed"].sharding.device_set
    info = vl_engine.get_server_info()
    vis = info["vision_encoder"]
    assert vis["precompiled"] and vis["buckets"] == [64, 128, 256] and info["precompile"]["programs"] >= 3
    weights = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(enc.params))
    assert (vis["weight_bytes"], vis["cache_cap_bytes"]) == (weights, 1 << 20) and vis["activation_bytes"] > 0
    assert vis["memory_bytes"] == enc.memory_bytes() == weights + (1 << 20) + vis["activation_bytes"]
    # The split took the encoder's bytes at load (before its programs existed: the estimate) out of the budget.
    assert info["memory_split"]["vision_encoder_bytes"] > weights + (1 << 20)
    (usage,) = info["internal_states"]
    assert usage["memory_usage"]["vision_encoder"] > 0
    before = compilation.jit_compilations()
    first = _images(path, [(8, 8), (64, 64)], seed=20)
    second = _images(path, [(24, 40), (16, 56), (40, 16)], seed=21)
    for items in (first[:1], first[1:], second):
        assert [e.shape for e in enc.encode(items)] == [(i.num_tokens, 64) for i in items]
    assert compilation.jit_compilations() == before
    assert vl_engine.get_server_info()["vision_encoder"]["stats"]["encoded"] >= 5
    pre = ImageInputs.for_engine(vl_engine).preprocessor
    assert pre is not None and pre.max_patches == enc.max_patches
