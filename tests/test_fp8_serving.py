"""#11 Done-when: a block-FP8 checkpoint built here (odd dims: partial 128 x 128 blocks everywhere, per-expert
keys, ``quantization_config`` as FP8 releases write it) served on 1 device and on 4 emulated devices (dp4,
ep4) gives the greedy tokens of HF transformers run on its offline-dequantised twin, and the devices hold
the quantised weights as FP8 arrays (``Fp8Weight``: float8_e4m3fn q, float32 scales).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from conftest import record  # noqa: E402
from emulated_devices import run_on_devices  # noqa: E402

from sglang_tpu_qwen.embedded.checkpoint import ensure_embedded_model  # noqa: E402
from sglang_tpu_qwen.model.checkpoint_writer import save_checkpoint  # noqa: E402
from sglang_tpu_qwen.quant.fp8_blocks import dequantize, quantize  # noqa: E402

BLOCK = (128, 128)
QUANTISATION_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                       "weight_block_size": list(BLOCK)}
# Every matrix dim below is off the 128 grid: 200, 136, 150, 320 (q + gate), 304 (conv dim), 144, 80.
CONFIG = dict(
    vocab_size=512, hidden_size=200, num_hidden_layers=4,
    layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    num_attention_heads=2, num_key_value_heads=1, head_dim=80,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=40, linear_value_head_dim=36,
    linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=136,
    shared_expert_intermediate_size=150, rms_norm_eps=1e-6, max_position_embeddings=512, eos_token_id=None,
    pad_token_id=0,
)  # fmt: skip
# HF names of the linear weights the FP8 releases quantise (router, gates, norms, embeddings, conv stay dense).
QUANTISED = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight", "in_proj_qkv.weight",
             "in_proj_z.weight", "out_proj.weight", "gate_proj.weight", "up_proj.weight", "down_proj.weight")
PROMPTS = [[5, 77, 301, 12, 9, 450, 3], list(range(20, 61, 3)), [400, 2, 2, 2, 511, 17]]
NUM_NEW = 10


def _randomise(model: Any) -> None:
    """Non-trivial norms / gates and decisive logits (greedy near-ties unlikely), as test_model_reference."""
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("linear_attn.norm.weight"):
                p.copy_(1.0 + 0.3 * noise)
            elif "norm" in name:
                p.copy_(0.3 * noise)
            elif name.endswith("dt_bias"):
                p.copy_(0.5 * noise)
            elif name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(-2.0, 1.0, generator=gen))
            elif name.endswith(("lm_head.weight", "embed_tokens.weight")):
                p.copy_(noise * 3.0 / math.sqrt(p.shape[1]))
            else:
                p.copy_(noise / math.sqrt(p.shape[-1]))


def _per_expert(state: dict[str, np.ndarray], num_layers: int) -> dict[str, np.ndarray]:
    """HF's in-memory fused experts -> the per-expert keys releases store."""
    out = {k: v for k, v in state.items() if ".mlp.experts." not in k}
    for li in range(num_layers):
        pre = f"model.layers.{li}.mlp.experts."
        gate_up, down = state[pre + "gate_up_proj"], state[pre + "down_proj"]
        half = gate_up.shape[1] // 2
        for e in range(gate_up.shape[0]):
            out[f"{pre}{e}.gate_proj.weight"] = gate_up[e, :half]
            out[f"{pre}{e}.up_proj.weight"] = gate_up[e, half:]
            out[f"{pre}{e}.down_proj.weight"] = down[e]
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[list[int]], int]:
    """(FP8 checkpoint dir, HF greedy tokens on the dequantised twin, number of quantised tensors)."""
    torch.manual_seed(0)
    hf_cfg = transformers.Qwen3_5MoeTextConfig(**CONFIG)
    model = transformers.Qwen3_5MoeForCausalLM(hf_cfg).eval()
    _randomise(model)
    state = _per_expert({k: v.numpy() for k, v in model.state_dict().items()}, CONFIG["num_hidden_layers"])
    fp8: dict[str, np.ndarray] = {}
    twin: dict[str, np.ndarray] = {}
    for name, w in state.items():
        if name.endswith(QUANTISED):
            q, s = quantize(w, BLOCK)
            assert w.shape[0] % 128 or w.shape[1] % 128, name  # at least one partial block edge
            fp8[name], fp8[name + "_scale_inv"] = q, s
            twin[name] = dequantize(q, s, BLOCK)  # offline dequantisation: the oracle's weights
        else:
            fp8[name] = twin[name] = w
    n_quantised = sum(n.endswith("_scale_inv") for n in fp8)
    root = tmp_path_factory.mktemp("fp8")
    cfg = hf_cfg.to_dict()
    quant = {"quantization_config": QUANTISATION_CONFIG}
    for d, tensors, extra in ((root / "fp8", fp8, quant), (root / "twin", twin, {})):
        save_checkpoint(tensors, d, max_shard_bytes=4 << 20)
        (d / "config.json").write_text(json.dumps({**cfg, **extra}))
    oracle = transformers.Qwen3_5MoeForCausalLM.from_pretrained(root / "twin", dtype=torch.float32).eval()
    want = []
    with torch.no_grad():
        for ids in PROMPTS:
            out = oracle.generate(torch.tensor([ids]), max_new_tokens=NUM_NEW, do_sample=False, eos_token_id=None,
                                  pad_token_id=0)
            want.append(out[0, len(ids):].tolist())
    return root / "fp8", want, n_quantised


ENGINE_ARGS = dict(dtype="float32", context_length=128, max_total_tokens=512, max_running_requests=4,
                   chunked_prefill_size=64, grammar_backend="none", skip_server_warmup=True)


def _serve(model_dir: str, **parallel: int) -> dict[str, Any]:
    """Greedy tokens of our Engine on the FP8 checkpoint, and what its devices hold."""
    from sglang_tpu_qwen.engine.engine import Engine
    from sglang_tpu_qwen.quant.fp8 import QUANTISED_LEAVES, Fp8Weight

    # --chunked-prefill-size is split over the DP ranks (SGLang's rule): each rank prefills 64 tokens per step.
    args = {**ENGINE_ARGS, "chunked_prefill_size": 64 * parallel.get("dp_size", 1), **parallel}
    eng = Engine(model_path=model_dir, tokenizer_path=str(ensure_embedded_model()), **args)
    try:
        replies = eng.generate(input_ids=PROMPTS, sampling_params={"temperature": 0, "max_new_tokens": NUM_NEW,
                                                                   "ignore_eos": True})
        tokens = [r["output_ids"] for r in replies]
        fp8_leaves, dense_quantisable, fp8_shards = 0, 0, 0
        for path, x in jax.tree_util.tree_leaves_with_path(
                eng.runner.params, is_leaf=lambda v: isinstance(v, Fp8Weight)):
            if isinstance(x, Fp8Weight):
                fp8_leaves += math.prod(x.q.shape[:-2])  # matrices: one per layer (and expert) of a stack
                assert x.q.dtype == np.dtype("float8_e4m3fn") and x.scale.dtype == np.float32
                fp8_shards += sum(s.data.dtype == np.dtype("float8_e4m3fn") for s in x.q.addressable_shards)
            elif str(getattr(path[-1], "key", "")) in QUANTISED_LEAVES:
                dense_quantisable += 1
        return {"tokens": tokens, "fp8_matrices": fp8_leaves, "dense_quantisable": dense_quantisable,
                "fp8_shards": fp8_shards, "devices": len(eng.runner.memory_usage),
                "weight_bytes": [u["weight_bytes"] for u in eng.runner.memory_usage]}
    finally:
        eng.shutdown()


def _check(got: dict[str, Any], want: list[list[int]], n_quantised: int, where: str) -> None:
    record("FP8 checkpoint vs HF on its dequantised twin", f"{where}: {got['fp8_matrices']} FP8 matrices on "
           f"{got['devices']} device(s), weights per device {got['weight_bytes'][0] / 2**20:.2f} MiB; "
           f"greedy tokens equal HF: {got['tokens'] == want}")
    assert got["tokens"] == want, (got["tokens"], want)
    assert got["fp8_matrices"] == n_quantised and got["dense_quantisable"] == 0
    assert got["fp8_shards"] >= got["devices"]


def test_fp8_checkpoint_one_device(checkpoints) -> None:
    model_dir, want, n_quantised = checkpoints
    _check(_serve(str(model_dir)), want, n_quantised, "1 device")


def test_fp8_checkpoint_dp4_ep4(checkpoints) -> None:
    model_dir, want, n_quantised = checkpoints
    code = ("import json; from test_fp8_serving import _serve; "
            f"print('RESULT ' + json.dumps(_serve({str(model_dir)!r}, dp_size=4, ep_size=4)))")
    got = run_on_devices(code, 4)
    assert got["devices"] == 4
    _check(got, want, n_quantised, "dp4 ep4")
