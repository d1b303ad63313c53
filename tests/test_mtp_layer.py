"""The MTP layer (model/mtp.py) against an oracle built from HF transformers' own modules, and its loading.

HF transformers has no MTP model for Qwen3.5 (it drops ``mtp.*`` on load), so the oracle is assembled from HF's
parts as SGLang's / vLLM's ``qwen3_5_mtp`` wire them (``bench/spec_decode.hf_mtp_class``, which the benchmark
trains): ``Qwen3_5MoeRMSNorm`` x 3, a bias-free ``fc`` over
``[norm(embedding) ; norm(hidden)]``, one ``Qwen3_5MoeDecoderLayer`` (full attention, sparse MoE), the shared
``lm_head``. The checkpoint is a tiny random ``Qwen3_5MoeForCausalLM`` saved by HF with those modules' tensors
added under ``mtp.`` (HF's fused expert layout); a per-expert and a block-FP8 copy come from our writer.

Tolerances: LOGIT_TOL as tests/test_model_reference.py (fp32 both sides; a wrong wiring is off by O(1));
DECODE_TOL for the MTP layer fed one position at a time through its paged KV against the same positions in one
extend step (only the summation order differs).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from conftest import record  # noqa: E402
from safetensors.numpy import load_file, save_file  # noqa: E402

from sglang_tpu_qwen.bench.spec_decode import hf_mtp_class  # noqa: E402
from sglang_tpu_qwen.kernels.dispatch import KernelBackends  # noqa: E402
from sglang_tpu_qwen.model.checkpoint_writer import save_checkpoint, to_hf_state_dict  # noqa: E402
from sglang_tpu_qwen.model.config import load_config  # noqa: E402
from sglang_tpu_qwen.model.forward import (  # noqa: E402
    commit_gdn_states,
    compute_logits,
    forward_step,
    init_cache,
)
from sglang_tpu_qwen.model.forward_batch import ForwardBatch, ForwardMode  # noqa: E402
from sglang_tpu_qwen.model.mtp import mtp_forward  # noqa: E402
from sglang_tpu_qwen.model.weights import CheckpointError, load_params  # noqa: E402
from sglang_tpu_qwen.quant.fp8 import Fp8Weight  # noqa: E402
from sglang_tpu_qwen.quant.fp8_blocks import quantize  # noqa: E402

LOGIT_TOL = 1e-3
DECODE_TOL = 1e-4
FP8_TOL = 1e-3  # keep_fp8 (dequantised per tile in the matmul) vs the same weights dequantised at load
PAGE_SIZE = 4
PROMPT_LEN = 19
_BLOCK = (16, 16)

HF_CONFIG = dict(
    vocab_size=256, hidden_size=64, num_hidden_layers=4, rms_norm_eps=1e-6, max_position_embeddings=256,
    layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
    num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
    num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32, shared_expert_intermediate_size=48,
    mtp_num_hidden_layers=1, eos_token_id=None, pad_token_id=0,
)  # fmt: skip


def _randomise(module: Any, gen: Any) -> None:
    """Non-trivial values everywhere (HF init leaves norms at 0 and experts tiny)."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                p.copy_(0.3 * noise)  # zero-centred norms: 1 + w
            elif name.endswith(("lm_head.weight", "embed_tokens.weight")):
                p.copy_(noise * 3.0 / math.sqrt(p.shape[1]))
            else:
                p.copy_(noise / math.sqrt(p.shape[-1]))


def _oracle_logits(mtp: Any, model: Any, ids: list[int]) -> np.ndarray:
    """``[len(ids) - 1, V]``: the HF-module MTP layer's draft logits at positions 0 .. L-2 (predicting tokens
    2 .. L), from the HF model's final-norm hidden states."""
    with torch.no_grad():
        x = torch.tensor([ids])
        return mtp(model, x, model.model(x).last_hidden_state)[0].numpy()


@functools.cache
def _checkpoint(tmp: str) -> tuple[Any, Any, Path]:
    """(HF model, HF MTP oracle, checkpoint dir with mtp.* tensors), fp32, built once."""
    gen = torch.Generator().manual_seed(11)
    cfg = transformers.Qwen3_5MoeTextConfig(**HF_CONFIG)
    cfg._attn_implementation = "eager"
    model = transformers.Qwen3_5MoeForCausalLM(cfg).eval()
    _randomise(model, gen)
    mtp = hf_mtp_class()(cfg).eval()
    _randomise(mtp, gen)
    path = Path(tmp) / "mtp-ckpt"
    model.save_pretrained(path)
    tensors = load_file(str(path / "model.safetensors"))
    save_file({**tensors, **mtp.tensors()}, str(path / "model.safetensors"), metadata={"format": "pt"})
    return model, mtp, path


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any, Path]:
    return _checkpoint(str(tmp_path_factory.getbasetemp()))


def _prompt(vocab: int) -> list[int]:
    return np.random.default_rng(3).integers(1, vocab, size=PROMPT_LEN).tolist()


_BACKENDS = KernelBackends(platform="cpu")
_target = jax.jit(functools.partial(forward_step, backends=_BACKENDS), static_argnames="config")
_draft = jax.jit(functools.partial(mtp_forward, backends=_BACKENDS), static_argnames="config")


def _batch(ids: list[int], prefix: int, pages: np.ndarray) -> ForwardBatch:
    return ForwardBatch.of(jnp.asarray([ids], jnp.int32), jnp.asarray([prefix], jnp.int32),
                           jnp.asarray([len(ids)], jnp.int32), jnp.asarray([pages], jnp.int32),
                           jnp.asarray([1], jnp.int32))


def _our_mtp_logits(params: Any, config: Any, ids: list[int], decode: bool) -> tuple[np.ndarray, dict]:
    """Target prefill over ``ids``, then the MTP layer over positions 0 .. L-2 in one extend step or one
    position at a time (``decode``); returns the draft logits and the cache (pages shuffled, slot 1)."""
    n_pages = -(-len(ids) // PAGE_SIZE)
    pages = np.random.default_rng(4).permutation(np.arange(1, 1 + n_pages)).astype(np.int32)
    cache = init_cache(config, 1 + n_pages, PAGE_SIZE, 2, jnp.float32, mtp_layers=1)
    hidden, cache = _target(params, cache, _batch(ids, 0, pages), config=config)
    target_kv = np.asarray(cache["k"][: config.num_attn_layers])
    if not decode:
        z, cache = _draft(params, cache, _batch(ids[1:], 0, pages), hidden[:, :-1], config=config)
        rows = z[0]
    else:
        outs = []
        for p in range(len(ids) - 1):
            z, cache = _draft(params, cache, _batch([ids[p + 1]], p, pages), hidden[:, p : p + 1], config=config)
            outs.append(z[0, 0])
        rows = jnp.stack(outs)
    # The MTP layer writes only its own KV layer.
    np.testing.assert_array_equal(np.asarray(cache["k"][: config.num_attn_layers]), target_kv)
    return np.asarray(compute_logits(params, rows, config=config)), cache


def test_mtp_layer_matches_hf_modules(ckpt: tuple[Any, Any, Path]) -> None:
    model, hf_mtp, path = ckpt
    config = load_config(path)
    assert config.mtp_num_hidden_layers == 1
    params = load_params(path, config, jnp.float32, mtp=True)
    ids = _prompt(config.vocab_size)
    want = _oracle_logits(hf_mtp, model, ids)
    got, cache = _our_mtp_logits(params, config, ids, decode=False)
    err = float(np.abs(got - want).max())
    record("MTP layer", f"MTP draft logits vs HF modules (extend, {len(ids) - 1} positions): max |err| {err:.2e} "
                        f"(tol {LOGIT_TOL}, |logits| up to {np.abs(want).max():.1f})")
    assert err < LOGIT_TOL
    assert np.abs(np.asarray(cache["k"][config.num_attn_layers])).max() > 0  # its KV is in the pool
    step, _ = _our_mtp_logits(params, config, ids, decode=True)
    derr = float(np.abs(step - got).max())
    record("MTP layer", f"MTP decode one position at a time vs one extend step: max |err| {derr:.2e} "
                        f"(tol {DECODE_TOL})")
    assert derr < DECODE_TOL
    # Without mtp=True the same checkpoint loads the text model only (the mtp.* tensors are skipped).
    assert "mtp" not in load_params(path, config, jnp.float32)


def test_mtp_round_trip_per_expert_and_missing(ckpt: tuple[Any, Any, Path], tmp_path: Path) -> None:
    """Our writer's per-expert layout loads back to the same leaves; no mtp.* is an error naming them."""
    _, _, path = ckpt
    config = load_config(path)
    params = load_params(path, config, jnp.float32, mtp=True)
    tensors = to_hf_state_dict(params, config)
    assert "mtp.layers.0.mlp.experts.3.gate_proj.weight" in tensors and "mtp.fc.weight" in tensors
    save_checkpoint(tensors, tmp_path / "per-expert", max_shard_bytes=200_000)
    again = load_params(tmp_path / "per-expert", config, jnp.float32, mtp=True)
    for (kp, a), b in zip(jax.tree.leaves_with_path(again["mtp"]), jax.tree.leaves(params["mtp"]), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(kp))

    text_only = {k: v for k, v in tensors.items() if not k.startswith("mtp.")}
    save_checkpoint(text_only, tmp_path / "no-mtp")
    with pytest.raises(CheckpointError, match=r"needs the checkpoint's mtp\.\* tensors"):
        load_params(tmp_path / "no-mtp", config, jnp.float32, mtp=True)
    partial = {k: v for k, v in tensors.items() if k != "mtp.pre_fc_norm_hidden.weight"}
    save_checkpoint(partial, tmp_path / "partial")
    with pytest.raises(CheckpointError, match=r"missing tensor\(s\): mtp\.pre_fc_norm_hidden\.weight"):
        load_params(tmp_path / "partial", config, jnp.float32, mtp=True)


def test_mtp_layer_block_fp8(ckpt: tuple[Any, Any, Path], tmp_path: Path) -> None:
    """A block-FP8 checkpoint keeps the MTP layer's linear weights FP8 on the device and drafts the logits of
    the same weights dequantised at load."""
    _, _, path = ckpt
    config = load_config(path)
    tensors = to_hf_state_dict(load_params(path, config, jnp.float32, mtp=True), config, fused_experts=True)
    suffixes = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight", "in_proj_qkv.weight",
                "in_proj_z.weight", "out_proj.weight", "gate_proj.weight", "up_proj.weight", "down_proj.weight",
                "experts.gate_up_proj", "experts.down_proj", "mtp.fc.weight")
    for name in list(tensors):
        if name.endswith(suffixes):
            tensors[name], tensors[name + "_scale_inv"] = quantize(tensors[name].astype(np.float32), _BLOCK)
    out = tmp_path / "fp8"
    save_checkpoint(tensors, out)
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": list(_BLOCK)}
    (out / "config.json").write_text(json.dumps(cfg))
    fp8 = load_params(out, config, jnp.float32, keep_fp8=True, mtp=True)
    for leaf in (fp8["mtp"]["fc"], fp8["mtp"]["layer"]["attn"]["q_proj"], fp8["mtp"]["layer"]["moe"]["w_gate"]):
        assert isinstance(leaf, Fp8Weight) and leaf.q.dtype == jnp.float8_e4m3fn
    dense = load_params(out, config, jnp.float32, mtp=True)
    ids = _prompt(config.vocab_size)
    got, _ = _our_mtp_logits(fp8, config, ids, decode=False)
    want, _ = _our_mtp_logits(dense, config, ids, decode=False)
    err = float(np.abs(got - want).max())
    record("MTP layer", f"MTP draft logits, block-FP8 kept vs dequantised at load: max |err| {err:.2e} "
                        f"(tol {FP8_TOL})")
    assert err < FP8_TOL


_verify = jax.jit(functools.partial(forward_step, backends=_BACKENDS), static_argnames="config")
_commit = jax.jit(commit_gdn_states, static_argnames="config")


@pytest.mark.parametrize("accepted", [0, 2, 4])
def test_verify_then_commit_equals_feeding_the_accepted_tokens(ckpt: tuple[Any, Any, Path],
                                                                accepted: int) -> None:
    """A TARGET_VERIFY step over 4 tokens leaves the GDN slot untouched; committing j of them gives the state
    (and the next step's output) of a plain extend over those j tokens, also in the snapshot slot it names."""
    _, _, path = ckpt
    config = load_config(path)
    params = load_params(path, config, jnp.float32)
    ids = _prompt(config.vocab_size)
    prompt, fed, after = ids[:11], ids[11:15], ids[15]
    pages = np.arange(1, 6, dtype=np.int32)

    def prefilled() -> dict:
        cache = init_cache(config, 6, PAGE_SIZE, 3, jnp.float32)  # slot 1 the request's, slot 2 a snapshot
        return _target(params, cache, _batch(prompt, 0, pages), config=config)[1]

    cache = prefilled()
    before = {k: np.asarray(cache[k]) for k in ("conv", "rec")}
    vb = dataclasses.replace(_batch(fed, len(prompt), pages), mode=ForwardMode.TARGET_VERIFY)
    v_hidden, cache, saved = _verify(params, cache, vb, config=config)
    for k in ("conv", "rec"):
        np.testing.assert_array_equal(np.asarray(cache[k]), before[k])
    cache = _commit(params, cache, vb, saved, jnp.asarray([accepted], jnp.int32), jnp.asarray([2], jnp.int32),
                    config=config)
    np.testing.assert_array_equal(np.asarray(cache["rec"][:, 2]), np.asarray(cache["rec"][:, 1]))
    conv = np.asarray(cache["conv"])  # [layers, slots * (K - 1), channels / lanes, lanes]
    conv = conv.reshape(conv.shape[0], -1, 3, conv.shape[2] * conv.shape[3])
    np.testing.assert_array_equal(conv[:, 2], conv[:, 1])
    nxt = fed[accepted] if accepted < len(fed) else after
    got, _ = _target(params, cache, _batch([nxt], len(prompt) + accepted, pages), config=config)

    ref = prefilled()
    if accepted:
        e_hidden, ref = _target(params, ref, _batch(fed[:accepted], len(prompt), pages), config=config)
        np.testing.assert_allclose(np.asarray(v_hidden[0, :accepted]), np.asarray(e_hidden[0]), atol=DECODE_TOL)
    want, ref = _target(params, ref, _batch([nxt], len(prompt) + accepted, pages), config=config)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=DECODE_TOL)
