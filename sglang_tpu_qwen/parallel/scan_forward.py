"""``forward_step`` with the layers under ``jax.lax.scan`` (for ahead-of-time planning of the real model).

The 60 layers of Qwen3.5-397B repeat one period (3 Gated DeltaNet layers, 1 attention layer); the
parameters of layer ``g * period + j`` are stacked as ``layers[j][leaf][g]`` and one scan step runs a
whole period with the model's own layer functions, so compile time does not grow with depth. Same
contract as ``model.forward.forward_step`` (docs/internals.md) otherwise; FP8 leaves (fp8.py) are
dequantised per layer inside the step, right before use.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from sglang_tpu_qwen.model.attention import attention_layer
from sglang_tpu_qwen.model.config import Qwen35MoeConfig
from sglang_tpu_qwen.model.gated_deltanet import gdn_layer_on_pools
from sglang_tpu_qwen.model.moe import moe_block
from sglang_tpu_qwen.model.norms import rms_norm
from sglang_tpu_qwen.model.rope import rope_cos_sin
from sglang_tpu_qwen.parallel.fp8 import dequantize_tree


def layer_period(config: Qwen35MoeConfig) -> int:
    """Smallest p with ``layer_types[i] == layer_types[i % p]``. Raises ValueError if none divides the depth."""
    types = config.layer_types
    n = len(types)
    for p in range(1, n + 1):
        if n % p == 0 and all(types[i] == types[i % p] for i in range(n)):
            return p
    raise ValueError("layer_types has no period")  # unreachable: p == n always works


def stack_layers(layers: list[Any], period: int) -> list[Any]:
    """Per-layer pytrees (arrays or ShapeDtypeStructs) -> ``period`` pytrees with a leading group dim."""

    def stack(*xs: Any) -> Any:
        if isinstance(xs[0], jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct((len(xs), *xs[0].shape), xs[0].dtype)
        return jnp.stack(xs)

    return [jax.tree.map(stack, *layers[j::period]) for j in range(period)]


def stack_params(params: dict[str, Any], config: Qwen35MoeConfig) -> dict[str, Any]:
    """The parameter pytree with ``layers`` replaced by :func:`stack_layers` of it."""
    return {**params, "layers": stack_layers(params["layers"], layer_period(config))}


def scan_forward_step(
    params: dict[str, Any],
    cache: dict[str, jax.Array],
    tokens: jax.Array,
    prefix_lens: jax.Array,
    new_lens: jax.Array,
    page_table: jax.Array,
    slot_ids: jax.Array,
    *,
    config: Qwen35MoeConfig,
    moe_fn: Callable[..., jax.Array] | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """``forward_step`` over :func:`stack_params` parameters (arguments and result as ``forward_step``)."""
    period = layer_period(config)
    kinds = config.layer_types[:period]
    n_attn = sum(k == "full_attention" for k in kinds)
    n_gdn = period - n_attn
    t = tokens.shape[1]
    ar = jnp.arange(t, dtype=jnp.int32)
    positions = prefix_lens[:, None] + ar[None, :]
    valid = ar[None, :] < new_lens[:, None]
    kv_lens = prefix_lens + new_lens
    fresh = prefix_lens == 0  # [B]: rows whose GDN state starts at zero
    cos, sin = rope_cos_sin(positions, config.rotary_dim, config.rope_theta)
    eps = config.rms_norm_eps
    dtype = params["embed"].dtype
    moe = moe_fn or moe_block

    def group(carry: tuple[jax.Array, ...], xs: tuple[jax.Array, list[Any]]) -> tuple[tuple[jax.Array, ...], None]:
        h, k_cache, v_cache, conv, rec = carry
        g, lps = xs
        attn_i, gdn_i = g * n_attn, g * n_gdn
        for kind, lp in zip(kinds, lps, strict=True):
            lp = dequantize_tree(lp, dtype)
            x = rms_norm(h, lp["input_norm"], eps)
            if kind == "full_attention":
                x, k_cache, v_cache = attention_layer(
                    lp["attn"], x, cos, sin, k_cache, v_cache, attn_i, page_table, positions, valid, kv_lens,
                    config,
                )
                attn_i += 1
            else:
                x, conv, rec = gdn_layer_on_pools(
                    lp["gdn"], x, conv, rec, gdn_i, slot_ids, fresh, valid, new_lens, config
                )
                gdn_i += 1
            h = h + x
            h = h + moe(lp["moe"], rms_norm(h, lp["post_attn_norm"], eps), config)
        return (h, k_cache, v_cache, conv, rec), None

    n_groups = config.num_hidden_layers // period
    carry = (params["embed"][tokens], cache["k"], cache["v"], cache["conv"], cache["rec"])
    (h, k_cache, v_cache, conv, rec), _ = jax.lax.scan(
        group, carry, (jnp.arange(n_groups, dtype=jnp.int32), params["layers"])
    )
    h = rms_norm(h, params["final_norm"], eps)
    return h, {"k": k_cache, "v": v_cache, "conv": conv, "rec": rec}
