"""Kernel backends say up front what they cannot run (issue 13 item 1): the fused Pallas GDN kernel and a
Gated DeltaNet head layout it does not support (linear_key_head_dim 16, linear_value_head_dim 24)."""

from __future__ import annotations

import json
import logging

import pytest

from sglang_tpu_qwen.embedded.checkpoint import embedded_config_dict
from sglang_tpu_qwen.kernels.dispatch import KernelBackends, gdn_pallas_unsupported, resolve_backends
from sglang_tpu_qwen.model.config import Qwen35MoeConfig

ODD_HEADS = {"linear_key_head_dim": 16, "linear_value_head_dim": 24}


def _config(**text: int) -> Qwen35MoeConfig:
    d = embedded_config_dict()
    d["text_config"].update(text)
    return Qwen35MoeConfig.from_hf_dict(d)


def test_supported_layout_passes():
    assert gdn_pallas_unsupported(_config()) is None
    assert resolve_backends("auto", "pallas", platform="cpu", config=_config()).gdn == "pallas"


def test_explicit_pallas_with_unsupported_layout_is_a_startup_error_naming_fields():
    with pytest.raises(ValueError) as e:
        resolve_backends("auto", "pallas", platform="tpu", config=_config(**ODD_HEADS))
    msg = str(e.value)
    for piece in ("--gdn-backend pallas", "linear_key_head_dim", "16", "linear_value_head_dim", "24",
                  "linear_num_key_heads"):
        assert piece in msg, msg


def test_auto_falls_back_to_reference_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="sglang_tpu_qwen.kernels.dispatch"):
        got = resolve_backends("auto", "auto", platform="tpu", config=_config(**ODD_HEADS))
    assert got == KernelBackends("pallas", "reference", False, "tpu")
    assert any("linear_value_head_dim" in r.getMessage() for r in caplog.records)


def test_engine_refuses_at_startup(tmp_path):
    """The real startup path: an Engine over such a checkpoint with --gdn-backend pallas fails before serving."""
    from sglang_tpu_qwen.embedded.checkpoint import ensure_embedded_model, init_embedded_params
    from sglang_tpu_qwen.engine.engine import Engine
    from sglang_tpu_qwen.model.checkpoint_writer import save_checkpoint, to_hf_state_dict

    d = embedded_config_dict()
    d["text_config"].update(ODD_HEADS)
    config = Qwen35MoeConfig.from_hf_dict(d)
    save_checkpoint(to_hf_state_dict(init_embedded_params(config), config, prefix="model.language_model."), tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(d))
    for f in ensure_embedded_model().iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            (tmp_path / f.name).symlink_to(f)
    small = dict(model_path=str(tmp_path), max_running_requests=2, context_length=64, disable_radix_cache=True,
                 grammar_backend="none")
    with pytest.raises(ValueError, match="linear_key_head_dim"):
        Engine(gdn_backend="pallas", **small)
