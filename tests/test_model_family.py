"""The rest of the family against HF transformers, on tiny checkpoints built here with transformers' own classes:

- dense Qwen3.5 (``Qwen3_5ForCausalLM`` tied, ``Qwen3_5ForConditionalGeneration`` untied with a vision tower
  whose tensors the loader skips), each as a BF16 checkpoint and as a block-FP8 one (partial blocks);
- Qwen3-Next (``Qwen3NextForCausalLM``: fused ``in_proj_qkvz`` / ``in_proj_ba``, one ``mlp_only_layers`` layer),
  BF16 and block-FP8 (``in_proj_qkvz`` quantised, regrouped as FP8);
- Qwen3.5-MoE with 3 value heads per key head.

Each goes through our loader (``load_config`` + ``load_params``) and the paged forward: prompt logits, a greedy
continuation with each step's logprobs against one full HF recompute. A dense checkpoint is also served over
HTTP with both Pallas kernels (interpret mode on CPU) and gives HF's greedy tokens and logprobs.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import logging
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from conftest import record  # noqa: E402
from emulated_devices import run_on_devices  # noqa: E402
from test_model_reference import LOGIT_TOL, _Batch, _randomise  # noqa: E402

from sglang_tpu_qwen.model.checkpoint_writer import save_checkpoint  # noqa: E402
from sglang_tpu_qwen.model.config import Qwen35MoeConfig, load_config  # noqa: E402
from sglang_tpu_qwen.model.forward import compute_logits  # noqa: E402
from sglang_tpu_qwen.model.weights import load_params  # noqa: E402
from sglang_tpu_qwen.quant.fp8 import Fp8Weight  # noqa: E402
from sglang_tpu_qwen.quant.fp8_blocks import dequantize, quantize  # noqa: E402

# log_softmax moves each logit by the same log-sum-exp, whose error is at most the largest logit error: a
# logprob's error is at most twice the logits'.
LOGPROB_TOL = 2 * LOGIT_TOL
NUM_NEW = 12
PROMPT_LENS = (13, 70)  # 70 > 64: the chunked GDN form crosses a chunk boundary
FP8_BLOCK = (32, 16)  # HF [out, in] blocks (each side divides 128, as the FP8 kernel needs); partial edges
# Qwen3-Next's in_proj_qkvz groups rows per key head (16, 16, 32, 32 here): 16-row blocks start each part on a
# block row, as the release's 128-row blocks do (dk = 128, r * dv = 256), so the loader regroups q and scales.
FP8_BLOCK_NEXT = (16, 32)
QUANTISED = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight", "in_proj_qkv.weight",
             "in_proj_z.weight", "in_proj_qkvz.weight", "out_proj.weight", "gate_proj.weight", "up_proj.weight",
             "down_proj.weight")

_TEXT = dict(
    vocab_size=512, hidden_size=64, num_hidden_layers=4,
    layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
    num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
    rms_norm_eps=1e-6, max_position_embeddings=512, eos_token_id=None, pad_token_id=0,
)  # fmt: skip
_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
               spatial_merge_size=2, temporal_patch_size=2)
_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)


def _hf_model(kind: str) -> Any:
    """A randomised tiny HF model of ``kind`` (see the module docstring)."""
    torch.manual_seed(0)
    if kind == "dense_tied":
        model = transformers.Qwen3_5ForCausalLM(
            transformers.Qwen3_5TextConfig(intermediate_size=96, tie_word_embeddings=True, **_TEXT))
    elif kind == "dense_untied":
        text = dict(_TEXT, intermediate_size=80, tie_word_embeddings=False, hidden_size=48, linear_key_head_dim=12)
        model = transformers.Qwen3_5ForConditionalGeneration(
            transformers.Qwen3_5Config(text_config=text, vision_config=_VISION, tie_word_embeddings=False))
    elif kind == "next":
        text = dict(_TEXT, layer_types=["linear_attention"] * 3 + ["full_attention"])
        model = transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(
            intermediate_size=96, decoder_sparse_step=1, mlp_only_layers=[1], **_MOE, **text))
    elif kind == "moe_3v":
        text = dict(_TEXT, linear_num_key_heads=2, linear_num_value_heads=6, linear_value_head_dim=8)
        model = transformers.Qwen3_5MoeForCausalLM(transformers.Qwen3_5MoeTextConfig(**_MOE, **text))
    else:
        raise AssertionError(kind)
    model.eval()
    _randomise(model, seed=len(kind) * 7 + ord(kind[0]))
    return model


def _fp8_twin(model: Any, root: Path, block: tuple[int, int] = FP8_BLOCK) -> tuple[Path, Any]:
    """Write ``model`` as a block-FP8 checkpoint (its linear weights quantised with ``block``, scales beside
    them) and return (its dir, the HF model on the offline-dequantised weights: the oracle)."""
    state = {k: v.numpy() for k, v in model.state_dict().items()}
    if isinstance(model, transformers.Qwen3NextForCausalLM):  # experts one by one, as the release stores them
        for li in range(model.config.num_hidden_layers):
            pre = f"model.layers.{li}.mlp.experts."
            if pre + "gate_up_proj" in state:
                gate_up, down = state.pop(pre + "gate_up_proj"), state.pop(pre + "down_proj")
                half = gate_up.shape[1] // 2
                for e in range(gate_up.shape[0]):
                    state[f"{pre}{e}.gate_proj.weight"] = gate_up[e, :half]
                    state[f"{pre}{e}.up_proj.weight"] = gate_up[e, half:]
                    state[f"{pre}{e}.down_proj.weight"] = down[e]
    fp8, twin = {}, {}
    for name, w in state.items():
        if name.endswith(QUANTISED) and "visual" not in name:
            q, s = quantize(w, block)
            fp8[name], fp8[name + "_scale_inv"] = q, s
            twin[name] = dequantize(q, s, block)
        else:
            fp8[name] = twin[name] = w
    if model.config.tie_word_embeddings:
        fp8.pop("lm_head.weight", None)  # a tied release stores no lm_head
    cfg = model.config.to_dict()
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": list(block)}
    save_checkpoint(fp8, root)
    (root / "config.json").write_text(json.dumps(cfg))
    (root / "twin").mkdir()
    save_checkpoint(twin, root / "twin")
    (root / "twin" / "config.json").write_text(json.dumps(model.config.to_dict()))
    return root, type(model).from_pretrained(root / "twin", dtype=torch.float32).eval()


@functools.cache
def _build(case: str, tmp: str) -> tuple[Any, Qwen35MoeConfig, Any, Path]:
    """(HF oracle in fp32, our config, our params in fp32, checkpoint dir) of ``case`` = ``kind`` or ``kind-fp8``.
    BF16 cases: the checkpoint is written in bfloat16 (as released) and both sides read it in float32."""
    kind, _, fmt = case.partition("-")
    model = _hf_model(kind)
    path = Path(tmp) / case
    if fmt == "fp8":
        path, model = _fp8_twin(model, path, FP8_BLOCK_NEXT if kind == "next" else FP8_BLOCK)
    else:
        model.to(torch.bfloat16).save_pretrained(path)
        model = type(model).from_pretrained(path, dtype=torch.float32).eval()
    config = load_config(path)
    params = load_params(path, config, dtype=jnp.float32, keep_fp8=fmt == "fp8")
    return model, config, params, path


CASES = ["dense_tied", "dense_tied-fp8", "dense_untied", "dense_untied-fp8", "next", "next-fp8", "moe_3v"]


@pytest.fixture(scope="module", params=CASES)
def setup(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, ...]:
    model, config, params, path = _build(request.param, str(tmp_path_factory.getbasetemp()))
    rng = np.random.default_rng(1)
    prompts = [rng.integers(1, config.vocab_size, size=n).tolist() for n in PROMPT_LENS]
    return request.param, model, config, params, prompts


def _hf_logits(model: Any, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def _report(case: str, what: str, err: float, tol: float) -> None:
    record("HF reference check, the family: max abs error vs tolerance (fp32)",
           f"[{case}] {what}: max abs err {err:.3e} (tol {tol:.1e})")
    assert err < tol, (case, what, err)


def test_config_and_params_of_the_case(setup: tuple[Any, ...]) -> None:
    case, model, config, params, _ = setup
    kind = case.split("-")[0]
    want_mlp = {"dense_tied": ("dense",) * 4, "dense_untied": ("dense",) * 4, "next": ("moe", "dense", "moe", "moe"),
                "moe_3v": ("moe",) * 4}[kind]
    assert config.mlp_types == want_mlp
    assert config.tie_word_embeddings == (kind == "dense_tied") and ("lm_head" in params) != config.tie_word_embeddings
    assert config.gdn_fused_projections == (kind == "next")
    layers = params["layers"]
    assert all(("mlp" in lp) == (k == "dense") and ("moe" in lp) == (k == "moe") for lp, k in
               zip(layers, want_mlp[: len(layers)], strict=True))
    if case.endswith("fp8"):  # the dense MLP weights stay block-FP8 in device memory, as the experts do
        dense = [lp for lp in layers if "mlp" in lp][0]["mlp"]
        assert all(isinstance(dense[k], Fp8Weight) and dense[k].q.dtype == jnp.float8_e4m3fn
                   for k in ("gate_proj", "up_proj", "down_proj"))
    if case == "next-fp8":  # regrouped from in_proj_qkvz, still FP8
        gdn = layers[0]["gdn"]
        assert isinstance(gdn["in_proj_qkv"], Fp8Weight) and isinstance(gdn["in_proj_z"], Fp8Weight)


@pytest.mark.parametrize("platform", ["tpu", "cpu"])
def test_prompt_logits_match_hf(setup: tuple[Any, ...], platform: str) -> None:
    case, model, config, params, prompts = setup
    if platform == "cpu" and case.endswith("fp8"):
        pytest.skip("the XLA:CPU forms differ from the accelerator forms in the GDN and expert math only, which "
                    "the BF16 twin of this case checks; FP8 changes the matmuls alone")
    batch = _Batch(config, num_rows=3, max_len=80)
    batch.add(0)
    batch.add(1)
    hidden = batch.step([prompts[0], prompts[1], []], params, width=72, platform=platform)
    for r, ids in enumerate(prompts):
        ours = np.asarray(compute_logits(params, jnp.asarray(hidden[r, : len(ids)]), config=config))
        ref = _hf_logits(model, ids)
        assert float(np.abs(ref).max()) > 3.0  # logits are not trivially small
        _report(case, f"prompt logits row {r} (len {len(ids)}, {platform} forms)", float(np.abs(ours - ref).max()),
                LOGIT_TOL)


def test_greedy_tokens_and_logprobs_match_hf(setup: tuple[Any, ...]) -> None:
    case, model, config, params, prompts = setup
    batch = _Batch(config, num_rows=3, max_len=max(PROMPT_LENS) + NUM_NEW)
    batch.add(0)
    batch.add(1)
    hidden = batch.step([prompts[0], prompts[1], []], params, width=72)
    last = np.stack([hidden[r, len(p) - 1] for r, p in enumerate(prompts)])
    outs: list[list[int]] = [[], []]
    step_logits = []
    for i in range(NUM_NEW):
        logits = np.asarray(compute_logits(params, jnp.asarray(last), config=config))
        step_logits.append(logits)
        for r in range(2):
            outs[r].append(int(np.argmax(logits[r])))
        if i + 1 < NUM_NEW:
            hidden = batch.step([[outs[0][-1]], [outs[1][-1]], []], params, width=1)
            last = hidden[:2, 0]
    for r, ids in enumerate(prompts):
        with torch.no_grad():
            gen = model.generate(torch.tensor([ids]), max_new_tokens=NUM_NEW, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)[0, len(ids):].tolist()
        assert outs[r] == gen, f"{case} row {r}: ours {outs[r]} vs HF {gen}"
        full = _log_softmax(_hf_logits(model, ids + gen)[len(ids) - 1 : len(ids) - 1 + NUM_NEW])
        ours = _log_softmax(np.stack([s[r] for s in step_logits]))
        _report(case, f"decode-step logprobs row {r} vs full recompute", float(np.abs(ours - full).max()),
                LOGPROB_TOL)


def test_vision_and_mtp_tensors_skipped_with_a_log_line(tmp_path_factory: pytest.TempPathFactory,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    _, config, _, path = _build("dense_untied", str(tmp_path_factory.getbasetemp()))
    with caplog.at_level(logging.INFO, logger="sglang_tpu_qwen.model.weights"):
        load_params(path, config, dtype=jnp.float32)
    lines = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(lines) == 1 and "model.visual." in lines[0], lines


# ---- served: a dense checkpoint over HTTP with both Pallas kernels (interpret mode on CPU) ----

# Small mixer dims (head_dim 64, GDN 2 key / 4 value heads of 32): a layout the fused GDN
# kernel takes (2 * Hk * dk = 128, a multiple of r * dv = 64), with a dense SwiGLU MLP.
_SERVED = dict(_TEXT, hidden_size=128, head_dim=64, linear_key_head_dim=32, linear_value_head_dim=32,
               intermediate_size=192, tie_word_embeddings=True,
               layer_types=["linear_attention"] * 3 + ["full_attention"])
SERVED_PROMPTS = [[5, 77, 301, 12, 9, 450, 3], list(range(20, 61, 3))]
SERVED_NEW = 6


def test_served_dense_checkpoint_with_pallas_kernels_matches_hf(tmp_path: Path) -> None:
    import requests
    from conftest import serve_app

    from sglang_tpu_qwen.embedded.checkpoint import ensure_embedded_model
    from sglang_tpu_qwen.engine.engine import Engine
    from sglang_tpu_qwen.server.app import create_app

    torch.manual_seed(0)
    model = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**_SERVED)).eval()
    _randomise(model, seed=5)
    model.save_pretrained(tmp_path)  # float32 on disk: served in float32
    want_ids, want_lp = [], []
    with torch.no_grad():
        for ids in SERVED_PROMPTS:
            gen = model.generate(torch.tensor([ids]), max_new_tokens=SERVED_NEW, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
            lp = _log_softmax(_hf_logits(model, ids + gen)[len(ids) - 1 : len(ids) - 1 + SERVED_NEW])
            want_ids.append(gen)
            want_lp.append([float(lp[i, t]) for i, t in enumerate(gen)])
    eng = Engine(model_path=str(tmp_path), tokenizer_path=str(ensure_embedded_model()), dtype="float32",
                 attention_backend="pallas", gdn_backend="pallas", page_size=4, max_total_tokens=256,
                 max_running_requests=2, context_length=64, chunked_prefill_size=64, disable_radix_cache=True,
                 grammar_backend="none", skip_server_warmup=True)
    try:
        assert (eng.runner.backends.attention.name, eng.runner.backends.gdn.name, eng.runner.backends.interpret) == (
            "pallas", "pallas", True)
        with serve_app(create_app(eng)) as url:
            reply = requests.post(f"{url}/generate", json={
                "input_ids": SERVED_PROMPTS, "return_logprob": True,
                "sampling_params": {"temperature": 0, "max_new_tokens": SERVED_NEW, "ignore_eos": True}},
                timeout=600)
    finally:
        eng.shutdown()
    assert reply.status_code == 200, reply.text
    for r, out in enumerate(reply.json()):
        assert out["output_ids"] == want_ids[r], (r, out["output_ids"], want_ids[r])
        got = [float(e[0]) for e in out["meta_info"]["output_token_logprobs"]]
        _report("served dense, pallas", f"output logprobs row {r}", float(np.abs(np.array(got) - want_lp[r]).max()),
                LOGPROB_TOL)



# ---- served with DP attention: the dense weights whole on every rank ----

def serve_greedy(model_dir: str, prompts: list[list[int]], num_new: int, **parallel: int) -> dict[str, Any]:
    """Greedy tokens of our Engine (float32) on ``model_dir`` and, per device, the bytes of its dense MLP
    weights (JSON-able: the dp test runs it in a child process with emulated devices)."""
    from sglang_tpu_qwen.embedded.checkpoint import ensure_embedded_model
    from sglang_tpu_qwen.engine.engine import Engine

    eng = Engine(model_path=model_dir, tokenizer_path=str(ensure_embedded_model()), dtype="float32",
                 context_length=128, max_total_tokens=512, max_running_requests=4,
                 chunked_prefill_size=64 * parallel.get("dp_size", 1), grammar_backend="none",
                 skip_server_warmup=True, **parallel)
    try:
        replies = eng.generate(input_ids=prompts, sampling_params={"temperature": 0, "max_new_tokens": num_new,
                                                                   "ignore_eos": True})
        mlp = [x for lp in eng.runner.params["layers"] for x in jax.tree.leaves(lp["mlp"])]
        per_device: dict[str, int] = {}
        for x in mlp:
            for shard in x.addressable_shards:  # a replicated leaf: every device holds the whole array
                assert shard.data.shape == x.shape
                per_device[str(shard.device)] = per_device.get(str(shard.device), 0) + shard.data.nbytes
        return {"tokens": [r["output_ids"] for r in replies], "mlp_bytes_per_device": per_device,
                "mlp_bytes": sum(x.nbytes for x in mlp)}
    finally:
        eng.shutdown()


def test_dense_fp8_checkpoint_served_dp4_ep4_matches_hf(tmp_path_factory: pytest.TempPathFactory) -> None:
    model, config, _, path = _build("dense_untied-fp8", str(tmp_path_factory.getbasetemp()))
    prompts = [[5, 77, 301, 12, 9, 450, 3], list(range(20, 61, 3)), [400, 2, 2, 2, 511, 17]]
    want = []
    with torch.no_grad():
        for ids in prompts:
            want.append(model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                                       pad_token_id=0)[0, len(ids):].tolist())
    code = ("import json; from test_model_family import serve_greedy; "
            f"print('RESULT ' + json.dumps(serve_greedy({str(path)!r}, {prompts!r}, 8, dp_size=4, ep_size=4)))")
    got = run_on_devices(code, 4)
    assert got["tokens"] == want, (got["tokens"], want)
    assert len(got["mlp_bytes_per_device"]) == 4
    assert set(got["mlp_bytes_per_device"].values()) == {got["mlp_bytes"]}  # the whole MLP on each rank

# ---- configs: the named releases, and the family's config.json forms ----

# The table of the released configs (#29), written independently of model/catalog.py: layers, hidden,
# q / kv heads, GDN key / value heads, and (experts, top-k, expert, shared) or the dense FFN width.
RELEASES = {
    "qwen3.5-397b-a17b": (60, 4096, 32, 2, 16, 64, (512, 10, 1024, 1024)),
    "qwen3.5-122b-a10b": (48, 3072, 32, 2, 16, 64, (256, 8, 1024, 1024)),
    "qwen3.5-35b-a3b": (40, 2048, 16, 2, 16, 32, (256, 8, 512, 512)),
    "qwen3.5-27b": (64, 5120, 24, 4, 16, 48, 17408),
    "qwen3.5-9b": (32, 4096, 16, 4, 16, 32, 12288),
    "qwen3.5-4b": (32, 2560, 16, 4, 16, 32, 9216),
    "qwen3.5-2b": (24, 2048, 8, 2, 16, 16, 6144),
    "qwen3.5-0.8b": (24, 1024, 8, 2, 16, 16, 3584),
    "qwen3-next-80b-a3b": (48, 2048, 16, 2, 16, 32, (512, 10, 512, 512)),
}


@pytest.mark.parametrize("name", sorted(RELEASES))
def test_catalog_entry_matches_the_release(name: str) -> None:
    from sglang_tpu_qwen.model.catalog import MODEL_CONFIGS, model_config

    c = model_config(name.upper())  # names are case-insensitive
    layers, hidden, nq, nkv, hk, hv, ffn = RELEASES[name]
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads) == (layers, hidden,
                                                                                                 nq, nkv)
    assert (c.linear_num_key_heads, c.linear_num_value_heads, c.head_dim, c.rotary_dim) == (hk, hv, 256, 64)
    assert c.layer_types == (("linear_attention",) * 3 + ("full_attention",)) * (layers // 4)
    if isinstance(ffn, tuple):
        assert c.is_moe and c.mlp_types == ("moe",) * layers
        assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size,
                c.shared_expert_intermediate_size) == ffn
    else:
        assert not c.is_moe and c.mlp_types == ("dense",) * layers and c.intermediate_size == ffn
    assert c.tie_word_embeddings == (name in ("qwen3.5-0.8b", "qwen3.5-2b", "qwen3.5-4b"))
    assert c.vocab_size == (151936 if name.startswith("qwen3-next") else 248320)
    assert c.gdn_fused_projections == name.startswith("qwen3-next")
    assert set(MODEL_CONFIGS) == set(RELEASES)


def test_family_config_forms_and_errors() -> None:
    text = dict(_TEXT, intermediate_size=96)
    nested = transformers.Qwen3_5Config(text_config=text, vision_config=_VISION).to_dict()
    flat = transformers.Qwen3_5TextConfig(**text).to_dict()
    a, b = Qwen35MoeConfig.from_hf_dict(nested), Qwen35MoeConfig.from_hf_dict(flat)
    assert a == b and a.mlp_types == ("dense",) * 4 and a.intermediate_size == 96 and a.num_experts == 0
    # Qwen3-Next: MoE where (i + 1) % decoder_sparse_step == 0 and i is not in mlp_only_layers (HF's rule).
    nxt = transformers.Qwen3NextConfig(**dict(_TEXT, num_hidden_layers=8, layer_types=None), **_MOE,
                                       intermediate_size=96, decoder_sparse_step=2, mlp_only_layers=[3]).to_dict()
    c = Qwen35MoeConfig.from_hf_dict(nxt)
    assert c.mlp_types == ("dense", "moe", "dense", "dense", "dense", "moe", "dense", "moe")
    assert c.gdn_fused_projections and c.is_moe
    with pytest.raises(ValueError, match="intermediate_size"):
        Qwen35MoeConfig.from_hf_dict({k: v for k, v in flat.items() if k != "intermediate_size"})
    # HF builds every Qwen3-Next layer dense when num_experts is 0; a Qwen3.5-MoE config needs the field.
    assert Qwen35MoeConfig.from_hf_dict(dict(nxt, num_experts=0)).mlp_types == ("dense",) * 8
    moe = transformers.Qwen3_5MoeTextConfig(**_TEXT, **_MOE).to_dict()
    with pytest.raises(ValueError, match="num_experts"):
        Qwen35MoeConfig.from_hf_dict({k: v for k, v in moe.items() if k != "num_experts"})


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu is not installed")
def test_planner_compiles_a_dense_release(tmp_path: Path) -> None:
    """The planner's deviceless Ironwood compile of a dense release's decode step (the server's program on
    abstract weights): every weight replicated (no expert stacks), the Pallas kernels, and it fits."""
    import os
    import subprocess
    import sys

    out = tmp_path / "plan.json"
    cmd = [sys.executable, "-m", "sglang_tpu_qwen.tools.plan", "--model-config", "qwen3.5-0.8b", "--topology",
           "tpu7x:2x2x1", "--dp", "8", "--ep", "8", "--max-running-requests", "64", "--context-length", "9216",
           "--fp8", "--steps", "decode", "--json", str(out)]
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    env["ALLOW_MULTIPLE_LIBTPU_LOAD"] = "1"
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(out.read_text())
    mem, step = r["memory_per_device"], r["steps"]["decode"]
    record("Planner: a dense release (Qwen3.5-0.8B FP8, tpu7x:2x2x1 dp8)",
           f"weights per device {mem['weights_replicated'] / 2**30:.2f} GiB, decode bytes ratio "
           f"{step['bytes_ratio']:.2f}, roofline {step['roofline_s'] * 1e3:.2f} ms")
    assert mem["weights_experts"] == 0 and 0.8 * 2**30 < mem["weights_replicated"] < 1.2 * 2**30
    assert r["kernels"] == {"attention": "pallas", "gdn": "pallas", "fp8_matmul": "pallas"}
    assert step["memory"]["fits"] and step["min_bytes"] <= step["bytes_accessed"]
