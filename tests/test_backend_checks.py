"""Kernel backends say up front what they cannot run (issue 13 item 1, issue 29): the fused Pallas GDN kernel
runs every head layout (value heads per key head 1-4, dk != dv) with no fallback; compiled for a TPU it needs
head dims that are multiples of 128, and a layout without them (linear_key_head_dim 16,
linear_value_head_dim 24) is a startup error there, or the reference with a warning under ``auto``."""

from __future__ import annotations

import json
import logging

import pytest

from sglang_tpu_qwen.embedded.checkpoint import embedded_config_dict
from sglang_tpu_qwen.kernels.dispatch import KernelBackends, gdn_pallas_unsupported, resolve_backends
from sglang_tpu_qwen.model.config import Qwen35MoeConfig

ODD_HEADS = {"linear_key_head_dim": 16, "linear_value_head_dim": 24}
# Released GDN head layouts (Qwen3.5 397B / 122B, 35B / 9B / 4B / Qwen3-Next-80B, 27B, 2B / 0.8B) and a
# dk != dv one, all at TPU-tileable dims.
TPU_LAYOUTS = [(16, 64, 128, 128), (16, 32, 128, 128), (16, 48, 128, 128), (16, 16, 128, 128), (16, 48, 256, 128)]


def _config(**text: int) -> Qwen35MoeConfig:
    d = embedded_config_dict()
    d["text_config"].update(text)
    return Qwen35MoeConfig.from_hf_dict(d)


def _heads(hk: int, hv: int, dk: int, dv: int) -> dict[str, int]:
    return {"linear_num_key_heads": hk, "linear_num_value_heads": hv, "linear_key_head_dim": dk,
            "linear_value_head_dim": dv}


def test_supported_layout_passes():
    assert gdn_pallas_unsupported(_config(), interpret=True) is None
    assert resolve_backends("auto", "pallas", platform="cpu", config=_config()).gdn.name == "pallas"


@pytest.mark.parametrize("heads", TPU_LAYOUTS, ids=[f"{hk}k-{hv}v-{dk}-{dv}" for hk, hv, dk, dv in TPU_LAYOUTS])
def test_released_layouts_run_the_kernel_on_tpu(heads, caplog):
    """No refusal and no fallback: ``auto`` and ``pallas`` both resolve to the kernel, without a warning."""
    config = _config(**_heads(*heads))
    assert gdn_pallas_unsupported(config) is None
    with caplog.at_level(logging.WARNING, logger="sglang_tpu_qwen.kernels.dispatch"):
        for flag in ("auto", "pallas"):
            assert resolve_backends("auto", flag, platform="tpu", config=config) == KernelBackends.of(
                "pallas", "pallas", False, "tpu")
    assert not caplog.records


def test_interpret_mode_takes_any_head_dims():
    got = resolve_backends("reference", "pallas", platform="cpu", config=_config(**ODD_HEADS))
    assert got == KernelBackends.of("reference", "pallas", True, "cpu")


def test_explicit_pallas_with_untileable_dims_on_tpu_is_a_startup_error_naming_fields():
    with pytest.raises(ValueError) as e:
        resolve_backends("auto", "pallas", platform="tpu", config=_config(**ODD_HEADS))
    msg = str(e.value)
    for piece in ("--gdn-backend pallas", "linear_key_head_dim", "16", "linear_value_head_dim", "24", "128"):
        assert piece in msg, msg


def test_auto_falls_back_to_reference_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="sglang_tpu_qwen.kernels.dispatch"):
        got = resolve_backends("auto", "auto", platform="tpu", config=_config(**ODD_HEADS))
    assert got == KernelBackends.of("pallas", "reference", False, "tpu")
    assert any("linear_value_head_dim" in r.getMessage() for r in caplog.records)


def test_engine_serves_three_value_heads_per_key_head_with_dk_ne_dv_in_the_kernel(tmp_path):
    """The real startup path over a checkpoint the kernel used to refuse (3 value heads per key head, dk 32,
    dv 48: the v groups do not start on a multiple of their width): ``--gdn-backend pallas`` runs the fused
    kernel (interpret mode) for the batched prefill and the decodes, and gives the reference GDN's greedy
    tokens."""
    from sglang_tpu_qwen.embedded.checkpoint import ensure_embedded_model, init_embedded_params
    from sglang_tpu_qwen.engine.engine import Engine
    from sglang_tpu_qwen.model.checkpoint_writer import save_checkpoint, to_hf_state_dict

    d = embedded_config_dict()
    d["text_config"].update(_heads(2, 6, 32, 48))
    config = Qwen35MoeConfig.from_hf_dict(d)
    assert (2 * 2 * 32) % (3 * 48)  # the layout the old kernel refused
    save_checkpoint(to_hf_state_dict(init_embedded_params(config), config, prefix="model.language_model."), tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(d))
    for f in ensure_embedded_model().iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            (tmp_path / f.name).symlink_to(f)
    small = dict(model_path=str(tmp_path), max_running_requests=2, context_length=128, disable_radix_cache=True,
                 grammar_backend="none", chunked_prefill_size=64, disable_precompile=True, skip_server_warmup=True,
                 precompile_bs_paddings=[2], precompile_token_paddings=[64])
    prompts = ["The quick brown fox jumps over", "a"]
    params = {"temperature": 0.0, "max_new_tokens": 4}
    out = {}
    for backend in ("reference", "pallas"):
        eng = Engine(gdn_backend=backend, attention_backend="reference", **small)
        try:
            assert eng.runner.backends.gdn.name == backend
            out[backend] = [r["output_ids"] for r in eng.generate(prompts, params)]
        finally:
            eng.shutdown()
    assert all(len(ids) == params["max_new_tokens"] for ids in out["reference"])
    assert out["pallas"] == out["reference"]
