"""HF safetensors <-> parameter pytree (model/weights.py loads, model/checkpoint_writer.py saves, through
model/param_layout.py's table) and the embedded checkpoint (embedded/checkpoint.py)."""

from __future__ import annotations

import hashlib
import json
import logging
import re
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from sglang_tpu_qwen.embedded.checkpoint import MODEL_DIRNAME, build_embedded_model, ensure_embedded_model
from sglang_tpu_qwen.model.checkpoint_writer import save_checkpoint, to_hf_state_dict
from sglang_tpu_qwen.model.config import Qwen35MoeConfig, load_config
from sglang_tpu_qwen.model.param_layout import param_specs
from sglang_tpu_qwen.model.safetensors_file import SafetensorsFile
from sglang_tpu_qwen.model.stacking import unstack_layers, unstack_params
from sglang_tpu_qwen.model.weights import CheckpointError, load_params
from tests.conftest import record


def small_config(tie: bool = False) -> Qwen35MoeConfig:
    return Qwen35MoeConfig.from_hf_dict(
        {
            "model_type": "qwen3_5_moe_text",
            "vocab_size": 64,
            "hidden_size": 32,
            "num_hidden_layers": 3,
            "layer_types": ["linear_attention", "full_attention", "linear_attention"],
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 16,
            "linear_num_key_heads": 1,
            "linear_num_value_heads": 2,
            "linear_key_head_dim": 8,
            "linear_value_head_dim": 8,
            "linear_conv_kernel_dim": 4,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 16,
            "shared_expert_intermediate_size": 8,
            "tie_word_embeddings": tie,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
        }
    )


def random_params(config: Qwen35MoeConfig, seed: int = 0):
    """bf16-exact values (so a bf16 round trip is lossless); A_log full float32."""
    rng = np.random.default_rng(seed)

    def make(sds: jax.ShapeDtypeStruct) -> np.ndarray:
        x = rng.standard_normal(sds.shape, np.float32)
        return x.astype(sds.dtype)

    return jax.tree.map(make, param_specs(config, ml_dtypes.bfloat16))


def assert_trees_equal(got, want) -> None:
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for (path, g), w in zip(jax.tree.leaves_with_path(got), jax.tree.leaves(want), strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype, jax.tree_util.keystr(path)
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("sharded", [False, True])
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("prefix", ["model.language_model.", "model."])
def test_round_trip(tmp_path: Path, prefix: str, fused: bool, sharded: bool, tie: bool) -> None:
    config = small_config(tie)
    params = random_params(config)
    tensors = to_hf_state_dict(params, config, prefix=prefix, fused_experts=fused)
    save_checkpoint(tensors, tmp_path, max_shard_bytes=20_000 if sharded else None)
    shards = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert (len(shards) > 2) == sharded, shards
    assert_trees_equal(load_params(tmp_path, config, jnp.bfloat16), params)


def test_layout_matches_hf_names(tmp_path: Path) -> None:
    """Hand-written HF tensors (independent of the loader's table) land where docs/internals.md says."""
    config = small_config()
    tensors = to_hf_state_dict(random_params(config, seed=1), config, prefix="model.")
    rng = np.random.default_rng(2)
    hd, nq, h = config.head_dim, config.num_attention_heads, config.hidden_size
    e, i = config.num_experts, config.moe_intermediate_size
    q = rng.standard_normal((nq * hd * 2, h), np.float32)  # HF [out, in]
    conv = rng.standard_normal((config.gdn_conv_dim, 1, 4), np.float32)
    gate_up = rng.standard_normal((e, 2 * i, h), np.float32)  # gate rows first
    down = rng.standard_normal((e, h, i), np.float32)
    tensors["model.layers.1.self_attn.q_proj.weight"] = q
    tensors["model.layers.0.linear_attn.conv1d.weight"] = conv
    for k in range(e):
        del tensors[f"model.layers.2.mlp.experts.{k}.gate_proj.weight"]
        del tensors[f"model.layers.2.mlp.experts.{k}.up_proj.weight"]
        del tensors[f"model.layers.2.mlp.experts.{k}.down_proj.weight"]
    tensors["model.layers.2.mlp.experts.gate_up_proj"] = gate_up
    tensors["model.layers.2.mlp.experts.down_proj"] = down
    save_file(tensors, str(tmp_path / "model.safetensors"))

    p = unstack_params(load_params(tmp_path, config, jnp.float32))
    np.testing.assert_array_equal(p["layers"][1]["attn"]["q_proj"], q.T)
    np.testing.assert_array_equal(p["layers"][0]["gdn"]["conv1d"], conv[:, 0, :])
    moe = p["layers"][2]["moe"]
    for k in range(e):
        np.testing.assert_array_equal(moe["w_gate"][k], gate_up[k, :i].T)
        np.testing.assert_array_equal(moe["w_up"][k], gate_up[k, i:].T)
        np.testing.assert_array_equal(moe["w_down"][k], down[k].T)
    # a per-expert layer of the same checkpoint
    w = tensors["model.layers.0.mlp.experts.3.up_proj.weight"].astype(np.float32)
    np.testing.assert_array_equal(p["layers"][0]["moe"]["w_up"][3], w.T)


def test_dtype_conversion_keeps_a_log_float32(tmp_path: Path) -> None:
    config = small_config()
    params = random_params(config)
    save_checkpoint(to_hf_state_dict(params, config), tmp_path)
    got = load_params(tmp_path, config, jnp.float32)
    assert got["embed"].dtype == jnp.float32
    np.testing.assert_array_equal(got["embed"], np.asarray(params["embed"], np.float32))
    got16 = load_params(tmp_path, config, jnp.bfloat16)
    assert got16["layers"][0]["gdn"]["A_log"].dtype == jnp.float32
    np.testing.assert_array_equal(got16["layers"][0]["gdn"]["A_log"], params["layers"][0]["gdn"]["A_log"])


def test_mtp_and_visual_skipped(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    config = small_config(tie=True)
    params = random_params(config)
    tensors = to_hf_state_dict(params, config)
    extra = np.zeros((3, 5), ml_dtypes.bfloat16)
    tensors.update(
        {
            "mtp.fc.weight": extra,
            "mtp.layers.0.mlp.gate.weight": extra,
            "model.visual.blocks.0.attn.qkv.weight": extra,
            "lm_head.weight": extra,  # a tied checkpoint may still carry a copy
        }
    )
    save_checkpoint(tensors, tmp_path)
    with caplog.at_level(logging.INFO, logger="sglang_tpu_qwen.model.weights"):
        got = load_params(tmp_path, config, jnp.bfloat16)
    assert_trees_equal(got, params)
    skip_lines = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(skip_lines) == 1 and "skipped 4 " in skip_lines[0], skip_lines


def _save_and_load(tmp_path: Path, tensors: dict[str, np.ndarray], config: Qwen35MoeConfig) -> str:
    save_checkpoint(tensors, tmp_path, max_shard_bytes=20_000)
    with pytest.raises(CheckpointError) as err:
        load_params(tmp_path, config, jnp.bfloat16)
    return str(err.value)


def test_missing_tensor(tmp_path: Path) -> None:
    config = small_config()
    tensors = to_hf_state_dict(random_params(config), config)
    del tensors["model.language_model.layers.2.mlp.experts.1.down_proj.weight"]
    msg = _save_and_load(tmp_path, tensors, config)
    assert "layers.2.mlp.experts.1.down_proj.weight" in msg
    assert "expected: (32, 16)" in msg and "found: absent" in msg


def test_unexpected_tensor(tmp_path: Path) -> None:
    config = small_config()
    tensors = to_hf_state_dict(random_params(config), config)
    tensors["model.language_model.layers.1.self_attn.rotary.weight"] = np.zeros((3, 5), ml_dtypes.bfloat16)
    msg = _save_and_load(tmp_path, tensors, config)
    assert "model.language_model.layers.1.self_attn.rotary.weight" in msg
    assert "expected: absent" in msg and "found: (3, 5)" in msg


def test_wrong_shape(tmp_path: Path) -> None:
    config = small_config()
    tensors = to_hf_state_dict(random_params(config), config)
    # HF in_proj_z is [Hv * dv, H] = [16, 32]; store it transposed
    tensors["model.language_model.layers.0.linear_attn.in_proj_z.weight"] = np.zeros((32, 16), np.float32)
    msg = _save_and_load(tmp_path, tensors, config)
    assert "model.language_model.layers.0.linear_attn.in_proj_z.weight" in msg
    assert "expected shape (16, 32)" in msg and "found (32, 16)" in msg


@pytest.mark.parametrize("fault", ["one_layer", "shape", "twice"])
def test_kv_cache_scales_loaded_or_refused(tmp_path: Path, fault: str) -> None:
    """FP8 KV cache scales load in any accepted spelling into float32 attn.k_scale / v_scale leaves; one layer
    without them, a non-scalar scale, or two spellings of one scale stop loading with the tensor's name."""
    config = small_config()
    tensors = to_hf_state_dict(random_params(config), config)
    pre = "model.language_model.layers.{}.self_attn."
    for n, li in enumerate(config.attn_layer_ids):
        tensors[pre.format(li) + ("k_proj.k_scale" if n % 2 else "k_scale")] = np.array([0.5 + li], np.float32)
        tensors[pre.format(li) + "attn.v_scale"] = np.array(0.25 + li, np.float32)
    save_checkpoint(tensors, tmp_path / "ok", max_shard_bytes=20_000)
    got = load_params(tmp_path / "ok", config, jnp.bfloat16, stacked=False)
    for li in config.attn_layer_ids:
        attn = got["layers"][li]["attn"]
        assert attn["k_scale"].dtype == jnp.float32 and attn["k_scale"].shape == ()
        assert (float(attn["k_scale"]), float(attn["v_scale"])) == (0.5 + li, 0.25 + li)
    first = pre.format(config.attn_layer_ids[0])
    if fault == "one_layer":
        del tensors[first + "attn.v_scale"]
        want = "v_scale (expected: (), found: absent)"
    elif fault == "shape":
        tensors[first + "attn.v_scale"] = np.ones(2, np.float32)
        want = "must be one float"
    else:
        tensors[first + "k_proj.k_scale"] = np.array([1.0], np.float32)
        want = "stored twice"
    assert want in _save_and_load(tmp_path / fault, tensors, config)


def test_reader_matches_safetensors(tmp_path: Path) -> None:
    """Our memory-mapped reader returns what safetensors wrote (bf16 and fp8 through ml_dtypes)."""
    rng = np.random.default_rng(4)
    tensors = {
        "a": rng.standard_normal((3, 5), np.float32).astype(ml_dtypes.bfloat16),
        "b": rng.standard_normal((7,), np.float32).astype(ml_dtypes.bfloat16),
        "c": rng.standard_normal((2, 4), np.float32).astype(ml_dtypes.float8_e4m3fn),
    }
    save_file(tensors, str(tmp_path / "x.safetensors"))
    with SafetensorsFile(tmp_path / "x.safetensors") as shard:
        for name, want in tensors.items():
            got = shard.get(name)
            assert got.dtype == want.dtype and got.shape == want.shape
            np.testing.assert_array_equal(got.astype(np.float32), want.astype(np.float32))


def test_no_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_params(tmp_path, small_config(), jnp.bfloat16)


# ---- the embedded model ----


@pytest.fixture(scope="session")
def embedded_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_embedded_model(tmp_path_factory.mktemp("cache"))


def _digests(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}


def test_embedded_layout(embedded_dir: Path) -> None:
    assert embedded_dir.name == MODEL_DIRNAME
    assert re.search(r"qwen.*(chat|instruct)", str(embedded_dir), re.IGNORECASE)
    assert sorted(p.name for p in embedded_dir.iterdir()) == [
        "config.json",
        "model.safetensors",
        "special_tokens_map.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    c = load_config(embedded_dir)
    assert c.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    assert (c.vocab_size, c.hidden_size, c.num_experts, c.num_experts_per_tok) == (248320, 128, 8, 2)
    assert c.eos_token_id == (248046,) and c.rotary_dim == 32 and c.rope_theta == 1e7  # 128 x 0.25
    assert ensure_embedded_model(embedded_dir.parent.parent) == embedded_dir  # cached: no rebuild


def test_embedded_is_deterministic(embedded_dir: Path, tmp_path: Path) -> None:
    again = build_embedded_model(tmp_path / "again")
    assert _digests(again) == _digests(embedded_dir)


def test_hf_loads_embedded_and_agrees(embedded_dir: Path) -> None:
    """transformers loads our layout with no missing/unexpected keys, into the same weights we load."""
    torch = pytest.importorskip("torch")
    from transformers import Qwen3_5MoeForCausalLM

    model, info = Qwen3_5MoeForCausalLM.from_pretrained(embedded_dir, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    hf = {k: v.to(torch.float32).numpy() for k, v in model.state_dict().items()}
    config = load_config(embedded_dir)
    ours = jax.tree.map(lambda x: np.asarray(x, np.float32), load_params(embedded_dir, config, jnp.bfloat16))

    # HF module layout (fused experts in memory) written out by hand, independently of weights.py.
    i = config.moe_intermediate_size
    np.testing.assert_array_equal(ours["embed"], hf["model.embed_tokens.weight"])
    np.testing.assert_array_equal(ours["lm_head"], hf["lm_head.weight"])
    np.testing.assert_array_equal(ours["final_norm"], hf["model.norm.weight"])
    for li, layer in enumerate(unstack_layers(ours["layers"])):
        pre = f"model.layers.{li}."
        np.testing.assert_array_equal(layer["input_norm"], hf[pre + "input_layernorm.weight"])
        moe = layer["moe"]
        gate_up = hf[pre + "mlp.experts.gate_up_proj"]
        np.testing.assert_array_equal(moe["w_gate"], gate_up[:, :i].transpose(0, 2, 1))
        np.testing.assert_array_equal(moe["w_up"], gate_up[:, i:].transpose(0, 2, 1))
        np.testing.assert_array_equal(moe["w_down"], hf[pre + "mlp.experts.down_proj"].transpose(0, 2, 1))
        np.testing.assert_array_equal(moe["router"], hf[pre + "mlp.gate.weight"].T)
        np.testing.assert_array_equal(moe["shared_expert_gate"], hf[pre + "mlp.shared_expert_gate.weight"].T)
        if "gdn" in layer:
            g = layer["gdn"]
            np.testing.assert_array_equal(g["conv1d"], hf[pre + "linear_attn.conv1d.weight"][:, 0])
            np.testing.assert_array_equal(g["A_log"], hf[pre + "linear_attn.A_log"])  # bf16-exact in fp32
            np.testing.assert_array_equal(g["in_proj_qkv"], hf[pre + "linear_attn.in_proj_qkv.weight"].T)
            np.testing.assert_array_equal(g["out_proj"], hf[pre + "linear_attn.out_proj.weight"].T)
        else:
            a = layer["attn"]
            np.testing.assert_array_equal(a["q_proj"], hf[pre + "self_attn.q_proj.weight"].T)
            np.testing.assert_array_equal(a["o_proj"], hf[pre + "self_attn.o_proj.weight"].T)
            np.testing.assert_array_equal(a["q_norm"], hf[pre + "self_attn.q_norm.weight"])


def test_fp8_block_quantised(tmp_path: Path) -> None:
    """A weight stored as float8_e4m3fn with a per-block ``weight_scale_inv`` loads dequantised."""
    config = small_config()
    tensors = to_hf_state_dict(random_params(config), config)
    rng = np.random.default_rng(3)
    name = "model.language_model.layers.1.self_attn.q_proj.weight"  # [64, 32]; blocks of 16 x 16
    w8 = rng.standard_normal((64, 32), np.float32).astype(ml_dtypes.float8_e4m3fn)
    scale = rng.uniform(0.5, 2.0, (4, 2)).astype(np.float32)
    tensors[name] = w8
    tensors[name + "_scale_inv"] = scale
    save_checkpoint(tensors, tmp_path)
    (tmp_path / "config.json").write_text('{"quantization_config": {"weight_block_size": [16, 16]}}')
    got = unstack_params(load_params(tmp_path, config, jnp.float32))["layers"][1]["attn"]["q_proj"]
    want = w8.astype(np.float32) * np.kron(scale, np.ones((16, 16), np.float32))
    np.testing.assert_array_equal(got, want.T)

    tensors[name + "_scale_inv"] = scale[:3]
    save_checkpoint(tensors, tmp_path)
    bad_scale = r"q_proj.weight_scale_inv: expected shape \(4, 2\).*found \(3, 2\)"
    with pytest.raises(CheckpointError, match=bad_scale):
        load_params(tmp_path, config, jnp.float32)


# ---- safetensors header validation (#14 point 3) ----


def _rewrite_header(path: Path, edit) -> None:
    """Apply ``edit(header_dict)`` to a safetensors file's JSON header, keeping the data bytes."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    edit(header)
    new = json.dumps(header).encode()
    path.write_bytes(len(new).to_bytes(8, "little") + new + raw[8 + n :])


def _one_file_checkpoint(tmp_path: Path) -> tuple[Qwen35MoeConfig, Path]:
    config = small_config()
    save_checkpoint(to_hf_state_dict(random_params(config), config), tmp_path)
    return config, tmp_path / "model.safetensors"


_EMBED = "model.language_model.embed_tokens.weight"
_NORM = "model.language_model.norm.weight"


@pytest.mark.parametrize(
    "corruption, message",
    [
        ("truncate", r"model.safetensors: tensor \S+: data_offsets \[\d+, \d+\] point past the end"),
        ("past_end", rf"model.safetensors: tensor {_EMBED}: data_offsets \[\d+, \d+\] point past the end"),
        ("overlap", r"model.safetensors: tensors \S+ and \S+ overlap"),
        ("dtype", rf"model.safetensors: tensor {_EMBED}: unknown dtype 'F7'"),
        ("length", rf"model.safetensors: tensor {_NORM}: 64 data bytes, but shape \(8,\) of BF16 needs 16"),
        ("header_json", r"model.safetensors: header is not valid JSON"),
        ("header_len", r"model.safetensors: header length \d+ does not fit the file's \d+ bytes"),
    ],
)
def test_corrupted_file_is_a_checkpoint_error(tmp_path: Path, corruption: str, message: str) -> None:
    """A truncated or corrupted safetensors file fails before any tensor reaches numpy or JAX, naming
    the file and the tensor."""
    config, path = _one_file_checkpoint(tmp_path)
    if corruption == "truncate":
        path.write_bytes(path.read_bytes()[:-100])
    elif corruption == "past_end":
        def edit(h):
            b, e = h[_EMBED]["data_offsets"]
            h[_EMBED]["data_offsets"] = [b + 10**9, e + 10**9]
        _rewrite_header(path, edit)
    elif corruption == "overlap":
        def edit(h):
            b, e = h[_NORM]["data_offsets"]
            h[_NORM]["data_offsets"] = [b - 2, e - 2]
        _rewrite_header(path, edit)
    elif corruption == "dtype":
        _rewrite_header(path, lambda h: h[_EMBED].update(dtype="F7"))
    elif corruption == "length":
        _rewrite_header(path, lambda h: h[_NORM].update(shape=[8]))
    elif corruption == "header_json":
        raw = bytearray(path.read_bytes())
        raw[9] = ord("}")  # inside the JSON header
        path.write_bytes(bytes(raw))
    elif corruption == "header_len":
        raw = path.read_bytes()
        path.write_bytes((len(raw) * 2).to_bytes(8, "little") + raw[8:])
    with pytest.raises(CheckpointError, match=message):
        load_params(tmp_path, config, jnp.float32)


# ---- block FP8: all or nothing (#13 item 7), FP8 leaves (#11 point 2) ----

# HF names (suffixes) of the linear weights FP8 releases quantise, written independently of the loader.
_QUANTISED_SUFFIXES = (
    "q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight", "in_proj_qkv.weight",
    "in_proj_z.weight", "out_proj.weight", "gate_proj.weight", "up_proj.weight", "down_proj.weight",
    "experts.gate_up_proj", "experts.down_proj",
)  # fmt: skip
_BLOCK = (16, 12)  # [rows, cols] of the HF [out, in] tensors: partial edge blocks in most matrices


def _fp8_checkpoint(config: Qwen35MoeConfig, fused: bool, seed: int = 5) -> dict[str, np.ndarray]:
    """HF tensors with every quantised linear weight in block FP8 (scale beside it)."""
    from sglang_tpu_qwen.quant.fp8_blocks import quantize

    tensors = to_hf_state_dict(random_params(config, seed), config, fused_experts=fused)
    for name in list(tensors):
        if name.endswith(_QUANTISED_SUFFIXES):
            q, s = quantize(tensors[name].astype(np.float32), _BLOCK)
            tensors[name] = q
            tensors[name + "_scale_inv"] = s
    return tensors


def _save_fp8(tmp_path: Path, tensors: dict[str, np.ndarray]) -> None:
    save_checkpoint(tensors, tmp_path, max_shard_bytes=20_000)
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(_BLOCK)}}))


_KINDS = {  # quantised tensor kind -> (checkpoint name, fused experts)
    "attention": ("model.language_model.layers.1.self_attn.o_proj.weight", False),
    "gdn": ("model.language_model.layers.0.linear_attn.in_proj_qkv.weight", False),
    "routed_expert": ("model.language_model.layers.2.mlp.experts.3.down_proj.weight", False),
    "shared_expert": ("model.language_model.layers.0.mlp.shared_expert.up_proj.weight", False),
    "fused_gate_up": ("model.language_model.layers.2.mlp.experts.gate_up_proj", True),
    "fused_down": ("model.language_model.layers.1.mlp.experts.down_proj", True),
}


@pytest.mark.parametrize("kind", list(_KINDS))
@pytest.mark.parametrize("fault", ["scale_missing", "weight_missing", "weight_not_fp8", "scale_shape"])
def test_fp8_scales_all_or_nothing(tmp_path: Path, kind: str, fault: str) -> None:
    config = small_config()
    name, fused = _KINDS[kind]
    scale = name + "_scale_inv"
    tensors = _fp8_checkpoint(config, fused)
    if fault == "scale_missing":
        del tensors[scale]
        pattern = rf"{re.escape(name)} is stored as F8_E4M3 but its block scale {re.escape(scale)} is absent"
    elif fault == "weight_missing":
        del tensors[name]
        pattern = rf"{re.escape(scale)} is a block scale, but its weight {re.escape(name)} is absent"
    elif fault == "weight_not_fp8":
        tensors[name] = tensors[name].astype(ml_dtypes.bfloat16)
        pattern = rf"{re.escape(scale)} is a block scale, but its weight {re.escape(name)} is stored as BF16"
    else:
        tensors[scale] = tensors[scale][..., :-1]
        pattern = rf"{re.escape(scale)}: expected shape .* of {re.escape(name)} .*, found"
    _save_fp8(tmp_path, tensors)
    with pytest.raises(CheckpointError, match=pattern):
        load_params(tmp_path, config, jnp.float32, keep_fp8=True)


def test_fp8_expert_stack_not_half_quantised(tmp_path: Path) -> None:
    config = small_config()
    tensors = _fp8_checkpoint(config, fused=False)
    name = "model.language_model.layers.1.mlp.experts.2.up_proj.weight"
    tensors[name] = tensors[name].astype(ml_dtypes.bfloat16)
    del tensors[name + "_scale_inv"]
    _save_fp8(tmp_path, tensors)
    mixed = rf"mixes block-FP8 and unquantised tensors: .* {re.escape(name)} is BF16"
    with pytest.raises(CheckpointError, match=mixed):
        load_params(tmp_path, config, jnp.float32, keep_fp8=True)


def _hf_to_leaf(x: np.ndarray) -> np.ndarray:
    """[out, in] -> [in, out] on the last two dims (our layout), written independently of the loader."""
    return np.swapaxes(x, -1, -2)


@pytest.mark.parametrize("fused", [False, True])
def test_fp8_stays_fp8(tmp_path: Path, fused: bool) -> None:
    """keep_fp8: every quantised weight is an Fp8Weight leaf holding the checkpoint's own q and scales,
    transposed into [in, out] with the block transposed (16 x 12 -> 12 x 16, partial edge blocks);
    without keep_fp8 the same checkpoint loads as its offline-dequantised twin."""
    from sglang_tpu_qwen.quant.fp8 import Fp8Weight
    from sglang_tpu_qwen.quant.fp8 import dequantize as device_dequantize
    from sglang_tpu_qwen.quant.fp8_blocks import dequantize

    config = small_config()
    tensors = _fp8_checkpoint(config, fused)
    _save_fp8(tmp_path, tensors)
    kept = unstack_params(load_params(tmp_path, config, jnp.float32, keep_fp8=True))
    dense = unstack_params(load_params(tmp_path, config, jnp.float32))
    pre = "model.language_model.layers."
    i = config.moe_intermediate_size
    checks = []
    for li, layer in enumerate(kept["layers"]):
        kind = ("self_attn", "attn", ("q_proj", "k_proj", "v_proj", "o_proj")) if "attn" in layer else \
            ("linear_attn", "gdn", ("in_proj_qkv", "in_proj_z", "out_proj"))
        for leaf in kind[2]:
            name = f"{pre}{li}.{kind[0]}.{leaf}.weight"
            checks.append((layer[kind[1]][leaf], dense["layers"][li][kind[1]][leaf], name, None, None))
        moe = layer["moe"]
        for leaf, hf in (("shared_gate", "gate_proj"), ("shared_up", "up_proj"), ("shared_down", "down_proj")):
            checks.append((moe[leaf], dense["layers"][li]["moe"][leaf], f"{pre}{li}.mlp.shared_expert.{hf}.weight",
                           None, None))
        for leaf, hf in (("w_gate", "gate_proj"), ("w_up", "up_proj"), ("w_down", "down_proj")):
            for e in range(config.num_experts):
                if fused:
                    name = f"{pre}{li}.mlp.experts." + ("down_proj" if leaf == "w_down" else "gate_up_proj")
                    rows = slice(None) if leaf == "w_down" else (slice(0, i) if leaf == "w_gate" else slice(i, 2 * i))
                    srows = slice(None) if leaf == "w_down" else (slice(0, i // 16) if leaf == "w_gate"
                                                                  else slice(i // 16, None))
                    q_hf, s_hf = tensors[name][e][rows], tensors[name + "_scale_inv"][e][srows]
                else:
                    name = f"{pre}{li}.mlp.experts.{e}.{hf}.weight"
                    q_hf, s_hf = tensors[name], tensors[name + "_scale_inv"]
                checks.append((moe[leaf], dense["layers"][li]["moe"][leaf], name, e, (q_hf, s_hf)))
        assert not isinstance(moe["router"], Fp8Weight) and moe["router"].dtype == jnp.float32
    for got, got_dense, name, e, qs in checks:
        assert isinstance(got, Fp8Weight), name
        assert got.q.dtype == jnp.float8_e4m3fn and got.scale.dtype == jnp.float32 and got.block == (12, 16)
        q_hf, s_hf = qs if qs is not None else (tensors[name], tensors[name + "_scale_inv"])
        q, s = (got.q, got.scale) if e is None else (got.q[e], got.scale[e])
        np.testing.assert_array_equal(np.asarray(q).view(np.uint8), _hf_to_leaf(q_hf).view(np.uint8), err_msg=name)
        np.testing.assert_array_equal(np.asarray(s), _hf_to_leaf(s_hf), err_msg=name)
        want = _hf_to_leaf(dequantize(q_hf, s_hf, _BLOCK))
        np.testing.assert_array_equal(np.asarray(got_dense if e is None else got_dense[e]), want, err_msg=name)
        np.testing.assert_array_equal(np.asarray(device_dequantize(got, jnp.float32))[() if e is None else e], want,
                                      err_msg=name)
    assert len(checks) == 1 * 4 + 2 * 3 + 3 * 3 + 3 * 3 * config.num_experts  # attn, gdn, shared, experts


def test_quantization_fp8_on_load(tmp_path: Path) -> None:
    """quantization='fp8' turns a bf16 checkpoint's linear weights into 128 x 128-block Fp8Weight leaves
    (one partial block here) whose dequantised values are within e4m3's rounding of the originals."""
    from sglang_tpu_qwen.quant.fp8 import QUANTISED_LEAVES, Fp8Weight, dequantize

    config = small_config()
    params = random_params(config)
    save_checkpoint(to_hf_state_dict(params, config), tmp_path)
    got = load_params(tmp_path, config, jnp.bfloat16, quantization="fp8")
    n = 0
    for (path, leaf), want in zip(jax.tree.leaves_with_path(got, is_leaf=lambda x: isinstance(x, Fp8Weight)),
                                  jax.tree.leaves(params), strict=True):
        name = str(getattr(path[-1], "key", ""))
        if name not in QUANTISED_LEAVES:
            assert not isinstance(leaf, Fp8Weight), name
            continue
        n += 1
        assert isinstance(leaf, Fp8Weight) and leaf.block == (128, 128) and leaf.q.dtype == jnp.float8_e4m3fn
        assert leaf.scale.shape == (*want.shape[:-2], 1, 1)
        w = np.asarray(want, np.float32)
        amax = np.abs(w).max(axis=(-2, -1), keepdims=True)
        err = np.abs(np.asarray(dequantize(leaf, jnp.float32)) - w)
        assert np.all(err <= amax / 448 * 16 + 1e-6), name  # e4m3: 3 mantissa bits, half-ulp <= 2^-4 * |x|
    assert n == 1 * 4 + 2 * 3 + 3 * 3 + 3 * 3  # attention, GDN, shared expert, expert stacks


# ---- weight integrity: --weights-manifest (#14 point 3) ----


def _manifest_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[Qwen35MoeConfig, dict]:
    """A sharded fused-expert FP8 checkpoint (reads out of file order) and the manifest the tool writes."""
    from sglang_tpu_qwen.tools.weights_manifest import main

    config = small_config()
    _save_fp8(tmp_path, _fp8_checkpoint(config, fused=True))
    main([str(tmp_path)])
    manifest = json.loads(capsys.readouterr().out)
    assert set(manifest) == {p.name for p in tmp_path.iterdir()} and len(manifest) > 4
    assert manifest["config.json"] == hashlib.sha256((tmp_path / "config.json").read_bytes()).hexdigest()
    return config, manifest


def test_weights_manifest_passes_and_tool_output(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config, manifest = _manifest_checkpoint(tmp_path, capsys)
    got = load_params(tmp_path, config, jnp.float32, keep_fp8=True, manifest=manifest)
    want = load_params(tmp_path, config, jnp.float32, keep_fp8=True)
    assert_trees_equal(got, want)


def _last_shard(tmp_path: Path) -> Path:
    return sorted(tmp_path.glob("model-*.safetensors"))[-1]


@pytest.mark.parametrize("fault", ["flipped_byte", "truncated", "past_end", "extra_file", "missing_file"])
def test_weights_manifest_refuses(tmp_path: Path, capsys: pytest.CaptureFixture[str], fault: str) -> None:
    config, manifest = _manifest_checkpoint(tmp_path, capsys)
    shard = _last_shard(tmp_path)
    if fault == "flipped_byte":  # inside tensor data: the header stays valid, only the digest can tell
        raw = bytearray(shard.read_bytes())
        raw[-3] ^= 0x01
        shard.write_bytes(bytes(raw))
        pattern = rf"sha256 of {shard.name} is [0-9a-f]{{64}}, the manifest says {manifest[shard.name]}"
    elif fault == "truncated":
        shard.write_bytes(shard.read_bytes()[:-10])
        pattern = rf"{shard.name}: tensor \S+: data_offsets .* point past the end"
    elif fault == "past_end":
        def edit(h):
            name = next(k for k in h if k != "__metadata__")
            h[name]["data_offsets"] = [v + (1 << 20) for v in h[name]["data_offsets"]]
        _rewrite_header(shard, edit)
        manifest[shard.name] = hashlib.sha256(shard.read_bytes()).hexdigest()  # a manifest of the bad file
        pattern = rf"{shard.name}: tensor \S+: data_offsets .* point past the end"
    elif fault == "extra_file":
        (tmp_path / "model-extra.safetensors").write_bytes(shard.read_bytes())
        pattern = r"file model-extra.safetensors in .* is not in the manifest \(extra file\)"
    else:
        (tmp_path / "config.json").rename(tmp_path / "config.json.bak")
        manifest["config.json.bak"] = manifest["config.json"]
        pattern = r"file config.json is missing from"
    with pytest.raises(CheckpointError, match=pattern):
        load_params(tmp_path, config, jnp.float32, keep_fp8=True, manifest=manifest)


def test_file_digest_out_of_order_reads(tmp_path: Path) -> None:
    """The loader's one-pass digest equals sha256 of the file whatever order tensors are read in."""
    rng = np.random.default_rng(0)
    tensors = {f"t{i}": rng.standard_normal((i + 3, 7), np.float32) for i in range(6)}
    save_file(tensors, str(tmp_path / "x.safetensors"), metadata={"format": "pt"})
    want = hashlib.sha256((tmp_path / "x.safetensors").read_bytes()).hexdigest()
    with SafetensorsFile(tmp_path / "x.safetensors", hash_bytes=True) as f:
        for name in ("t4", "t1", "t5", "t0", "t2"):  # t3 never read: hashed at the end
            info = f.tensors[name]
            f.get(name)
            f.digest.consumed(info.begin, info.end)
        assert f.sha256() == want


def test_server_refuses_to_start_on_manifest_mismatch(embedded_dir: Path, tmp_path: Path) -> None:
    """--weights-manifest reaches the loader: the model runner (what the server builds at start) raises,
    naming the file; with the right manifest it loads."""
    from sglang_tpu_qwen.args.server_args import ServerArgs
    from sglang_tpu_qwen.engine.runner.model_runner import ModelRunner
    from sglang_tpu_qwen.tools.weights_manifest import build_manifest

    manifest = build_manifest(embedded_dir)
    good, bad = tmp_path / "good.json", tmp_path / "bad.json"
    good.write_text(json.dumps(manifest))
    bad.write_text(json.dumps({**manifest, "model.safetensors": "0" * 64}))
    args = dict(max_total_tokens=256, max_running_requests=2, dtype="float32", chunked_prefill_size=64)
    with pytest.raises(CheckpointError, match="sha256 of model.safetensors is [0-9a-f]{64}, the manifest says 0000"):
        ModelRunner.from_checkpoint(str(embedded_dir), ServerArgs(weights_manifest=str(bad), **args))
    runner = ModelRunner.from_checkpoint(str(embedded_dir), ServerArgs(weights_manifest=str(good), **args))
    assert runner.params["embed"].shape == (248320, 128)


# ---- streaming load into shardings, stacked layout (#11 point 3) ----


def _stack_config() -> Qwen35MoeConfig:
    """4 layers, period 2 (GDN, attention), 8 experts."""
    return Qwen35MoeConfig.from_hf_dict({
        "model_type": "qwen3_5_moe_text", "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 4,
        "layer_types": ["linear_attention", "full_attention"] * 2, "num_attention_heads": 2,
        "num_key_value_heads": 1, "head_dim": 16, "linear_num_key_heads": 1, "linear_num_value_heads": 2,
        "linear_key_head_dim": 8, "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4, "num_experts": 8,
        "num_experts_per_tok": 2, "moe_intermediate_size": 16, "shared_expert_intermediate_size": 8,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
    })  # fmt: skip


def _streaming_child(model_dir: str) -> None:
    """Run in a process with 4 emulated devices: the stacked, sharded FP8 load equals the single-device
    per-layer load, and each device holds the replicated leaves plus exactly 1/4 of every expert stack."""
    from sglang_tpu_qwen.model.stacking import layer_period
    from sglang_tpu_qwen.parallel.mesh import make_layout
    from sglang_tpu_qwen.parallel.sharding import EXPERT_LEAVES, param_pspecs, shardings
    from sglang_tpu_qwen.quant.fp8 import Fp8Weight

    assert len(jax.devices()) == 4
    config = _stack_config()
    layout = make_layout(4, 4, 1)
    want = load_params(model_dir, config, jnp.float32, keep_fp8=True, stacked=False)
    from sglang_tpu_qwen.model import weight_placement

    def load_stacked() -> Any:
        return load_params(model_dir, config, jnp.float32, keep_fp8=True,
                           shardings=lambda abstract: shardings(param_pspecs(abstract, layout), layout))

    host_stacked = load_stacked()  # small leaves: rows stacked on the host
    weight_placement.HOST_STACK_BYTES = 0
    got = load_stacked()  # every leaf written row by row into its device buffers
    for (path, a), b in zip(jax.tree.leaves_with_path(got), jax.tree.leaves(host_stacked), strict=True):
        assert a.sharding == b.sharding, jax.tree_util.keystr(path)
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    assert layer_period(config) == 2 and len(got["layers"]) == 2
    assert got["layers"][1]["moe"]["w_gate"].q.shape == (2, 8, 32, 16)
    assert isinstance(got["layers"][0]["gdn"]["in_proj_qkv"], Fp8Weight)
    flat_got = jax.tree.leaves_with_path(unstack_params(got))
    flat_want = jax.tree.leaves(want)
    assert len(flat_got) == len(flat_want)
    for (path, g), w in zip(flat_got, flat_want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape, jax.tree_util.keystr(path)
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32),
                                      err_msg=jax.tree_util.keystr(path))
    expert = replicated = 0
    for path, x in jax.tree_util.tree_leaves_with_path(got):
        is_expert = bool({getattr(k, "key", None) for k in path} & EXPERT_LEAVES)
        expert += x.nbytes if is_expert else 0
        replicated += 0 if is_expert else x.nbytes
        for shard in x.addressable_shards:
            assert shard.data.nbytes == (x.nbytes // 4 if is_expert else x.nbytes), jax.tree_util.keystr(path)
    per_device: dict = {}
    for x in jax.tree.leaves(got):
        for shard in x.addressable_shards:
            per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
    assert sorted(per_device.values()) == [replicated + expert // 4] * 4, (per_device, replicated, expert)
    print(f"STREAMING-OK per device {replicated + expert // 4} bytes of {replicated + expert}")


def test_streaming_stacked_load_on_4_devices(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    config = _stack_config()
    tensors = _fp8_checkpoint(config, fused=False)
    for name in [n for n in tensors if ".layers.3.mlp.experts." in n and not n.endswith("_scale_inv")]:
        del tensors[name]  # layer 3 stores its experts fused (and FP8): both layouts in one stack
        del tensors[name + "_scale_inv"]
    from sglang_tpu_qwen.quant.fp8_blocks import quantize

    fused = to_hf_state_dict(random_params(config, 6), config, fused_experts=True)
    for k in ("gate_up_proj", "down_proj"):
        name = f"model.language_model.layers.3.mlp.experts.{k}"
        tensors[name], tensors[name + "_scale_inv"] = quantize(fused[name].astype(np.float32), _BLOCK)
    _save_fp8(tmp_path, tensors)
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4")
    code = f"from tests.test_weights import _streaming_child; _streaming_child({str(tmp_path)!r})"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600,
                          cwd=Path(__file__).resolve().parent.parent)
    assert proc.returncode == 0 and "STREAMING-OK" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    record("weights", proc.stdout.strip().splitlines()[-1])
