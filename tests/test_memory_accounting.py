"""Memory accounting (engine/runner/memory_accounting.py): the KV pool is what is left after the weights and the
GDN slots, from the dtypes in use; /get_server_info reports memory_usage per device as SGLang does."""

from __future__ import annotations

import math
from typing import Any

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sglang_tpu_qwen.engine.runner import memory_accounting
from sglang_tpu_qwen.engine.runner.memory_accounting import GB, CacheUnits, cache_units, kv_pool_tokens
from sglang_tpu_qwen.engine.runner.sizing import resolve_state_dtype
from sglang_tpu_qwen.model.config import Qwen35MoeConfig


def _config(**extra: Any) -> Qwen35MoeConfig:
    return Qwen35MoeConfig.from_hf_dict({**extra,
        "model_type": "qwen3_5_moe_text", "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 4,
        "layer_types": ["linear_attention"] * 3 + ["full_attention"], "num_attention_heads": 2,
        "num_key_value_heads": 2, "head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
        "linear_key_head_dim": 8, "linear_value_head_dim": 6, "linear_conv_kernel_dim": 4, "num_experts": 4,
        "num_experts_per_tok": 2, "moe_intermediate_size": 16, "shared_expert_intermediate_size": 8,
    })  # fmt: skip


def test_state_dtype_from_the_flag_else_the_checkpoint() -> None:
    """--mamba-ssm-dtype wins; unset, the config's mamba_ssm_dtype (Qwen3.5 releases: float32); absent, float32."""
    assert resolve_state_dtype(None, _config()) == jnp.float32
    assert resolve_state_dtype(None, _config(mamba_ssm_dtype="bfloat16")) == jnp.bfloat16
    assert resolve_state_dtype("float32", _config(mamba_ssm_dtype="bfloat16")) == jnp.float32
    assert resolve_state_dtype("bfloat16", _config(mamba_ssm_dtype="float32")) == jnp.bfloat16
    with pytest.raises(ValueError, match="the checkpoint's mamba_ssm_dtype must be one of float32, bfloat16"):
        resolve_state_dtype(None, _config(mamba_ssm_dtype="float16"))


@pytest.mark.parametrize("kv_dtype, state_dtype", [(jnp.bfloat16, jnp.float32), (jnp.float32, jnp.bfloat16),
                                                   (jnp.float8_e4m3fn, jnp.float32)])
def test_cache_units_follow_the_dtypes(kv_dtype, state_dtype) -> None:
    c = _config()
    u = cache_units(c, 16, kv_dtype, state_dtype)
    kv_item, st_item = jnp.dtype(kv_dtype).itemsize, jnp.dtype(state_dtype).itemsize
    # K and V of 1 attention layer, 16 tokens, 2 heads x 16; conv [conv_dim, K-1] + rec [Hv, dk, dv] x 3 GDN layers.
    assert u.kv_per_page == 2 * 1 * 16 * 2 * 16 * kv_item
    conv_dim = 2 * 2 * 8 + 4 * 6
    assert u.gdn_per_slot == 3 * (conv_dim * 3 + 4 * 8 * 6) * st_item
    assert u.kv_per_token == u.kv_per_page // 16


class _Device:
    """A device that reports a memory limit (the accelerators do; XLA:CPU does not)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit

    def memory_stats(self) -> dict[str, int]:
        return {"bytes_limit": self.limit}


def test_pool_is_sized_after_weights_and_gdn_slots() -> None:
    units = CacheUnits(kv_per_page=1 << 20, gdn_per_slot=3 << 20, page_size=64)
    dev = _Device(100 << 20)
    # 0.8 * 100 MiB - 20 MiB weights - 5 slots x 3 MiB = 45 MiB -> 45 pages, one of them the trash page.
    assert kv_pool_tokens(dev, 0.8, 20 << 20, 5, units) == 44 * 64
    assert kv_pool_tokens(dev, 0.8, 20 << 20, 0, units) == 59 * 64  # fewer slots, more pages
    with pytest.raises(ValueError, match=r"not enough device memory for the KV pool: .* 20 GDN slots"):
        kv_pool_tokens(dev, 0.8, 20 << 20, 20, units)


def test_engine_memory_usage(engine) -> None:
    """The session engine (one device): weight = the parameter bytes, kvcache = its pool at its dtype."""
    runner = engine.runner
    (usage,) = runner.memory_usage
    leaves = jax.tree.leaves(runner.params)
    assert usage["weight_bytes"] == sum(x.nbytes for x in leaves) > 0
    assert math.isclose(usage["weight"], usage["weight_bytes"] / GB, rel_tol=1e-4)
    kv = runner.cache["k"].nbytes + runner.cache["v"].nbytes
    assert kv == runner.sizing.num_pages * runner.sizing.units.kv_per_page
    assert math.isclose(usage["kvcache"], kv / GB, rel_tol=1e-4)
    state = runner.cache["conv"].nbytes + runner.cache["rec"].nbytes
    assert state == runner.sizing.num_slots * runner.sizing.units.gdn_per_slot
    assert usage["token_capacity"] == (runner.sizing.num_pages - 1) * runner.sizing.page_size
    info = engine.get_server_info()
    assert info["internal_states"] == [{"memory_usage": usage}]
    assert np.dtype(runner.cache["k"].dtype) == np.dtype(runner.dtype) == np.dtype(runner.kv_dtype)  # auto
    assert (info["kv_cache_dtype"], usage["kv_cache_dtype"]) == ("auto", np.dtype(runner.dtype).name)


def test_server_info_shows_memory_usage(server) -> None:
    info = httpx.get(server.url + "/get_server_info", timeout=30).json()
    usage = info["internal_states"][0]["memory_usage"]
    assert {"weight", "kvcache", "token_capacity"} <= usage.keys() and usage["weight"] > 0
    assert usage == memory_accounting.memory_usage(server.engine.runner.params, server.engine.runner.cache,
                                                   usage["token_capacity"])[0]


def test_kv_cache_dtype_resolves_and_fp8_pool_holds_twice_the_tokens() -> None:
    from sglang_tpu_qwen.engine.runner.sizing import resolve_kv_dtype

    assert resolve_kv_dtype("auto", jnp.float32) == jnp.float32  # auto: the compute dtype, unchanged
    assert resolve_kv_dtype("bf16", jnp.float32) == resolve_kv_dtype("bfloat16", jnp.float32) == jnp.bfloat16
    assert resolve_kv_dtype("fp8_e4m3", jnp.bfloat16) == jnp.float8_e4m3fn
    with pytest.raises(ValueError, match="--kv-cache-dtype"):
        resolve_kv_dtype("fp8_e5m2", jnp.bfloat16)
    c, dev = _config(), _Device(8 * GB)
    bf16 = kv_pool_tokens(dev, 0.5, GB, 10, cache_units(c, 16, jnp.bfloat16, jnp.float32))
    fp8 = kv_pool_tokens(dev, 0.5, GB, 10, cache_units(c, 16, jnp.float8_e4m3fn, jnp.float32))
    assert abs(fp8 - 2 * bf16) <= 2 * 16  # the same bytes, twice the tokens (page rounding aside)
