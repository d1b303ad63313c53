"""Pure-jnp reference of the fused GDN kernel: the model's own conv1d + gated delta rule over state pools.

Same signature and layouts as :func:`kernel.fused_gdn`. The math is ``delta_rule.gdn_mix``
(Yang et al., ICLR 2025 / NeurIPS 2024), which is what the model runs off TPU; this wrapper only gathers
each row's states from the pools by slot id and scatters them back, as ``model.forward`` does.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

import jax
import jax.numpy as jnp

from sglang_tpu_qwen.kernels.gdn.conv_pool import gather_windows, scatter_windows
from sglang_tpu_qwen.kernels.gdn.delta_rule import gated_rms_norm, gdn_mix
from sglang_tpu_qwen.kernels.gdn.kernel import RECURRENT_MAX_T


def fused_gdn_reference(
    mixed: jax.Array,
    conv_weight: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    conv_pool: jax.Array,
    rec_pool: jax.Array,
    layer: jax.Array | int,
    slot_ids: jax.Array,
    new_lens: jax.Array,
    fresh: jax.Array,
    *,
    num_k_heads: int,
    head_k_dim: int,
    head_v_dim: int,
    gate: jax.Array | None = None,
    norm_weight: jax.Array | None = None,
    norm_eps: float = 1e-6,
    recurrent_max_t: int = RECURRENT_MAX_T,
    commit: bool = True,
    chunk_rule: Callable[..., tuple[jax.Array, jax.Array]] | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Reference of ``fused_gdn`` (shapes as the kernel).

    Args:
        mixed: ``[B, T, conv_dim]``; conv_weight: ``[conv_dim, K]``; g, beta: ``[B, T, Hv]`` float32.
        conv_pool: ``[L, S * (K-1), conv_dim / 128, 128]`` (kernels/gdn/conv_pool.py); rec_pool: ``[L, S, Hv, dk, dv]``.
        layer: GDN-layer index; slot_ids, new_lens: ``[B]`` int32; fresh: ``[B]`` bool.
        num_k_heads, head_k_dim, head_v_dim: Hk, dk, dv.
        gate: ``[B, T, Hv * dv]`` or None; norm_weight: ``[dv]``; norm_eps: the output norm (as the kernel).
        recurrent_max_t: ``T <= recurrent_max_t`` runs ``delta_rule.recurrent_gated_delta_rule``, a longer T
            the chunked form (the kernel's split). The kernel rounds a bf16 state after every token of the
            recurrent form (as decode steps would); this reference carries it in float32 within the call.
        commit: False: the pools come back unchanged (a speculative verify step).
        chunk_rule: the chunked form for a longer T (``delta_rule.gdn_mix``; None: the reference's).

    Returns:
        ``(o [B, T, Hv, dv], conv_pool, rec_pool)``: ``o`` float32, or normed in ``gate.dtype`` with ``gate``.
    """
    t = mixed.shape[1]
    hv = g.shape[-1]
    # The head layout gdn_mix reads (delta_rule.GdnDims).
    dims = SimpleNamespace(
        linear_num_key_heads=num_k_heads, linear_num_value_heads=hv, linear_key_head_dim=head_k_dim,
        linear_value_head_dim=head_v_dim, gdn_key_dim=num_k_heads * head_k_dim)
    valid = jnp.arange(t, dtype=jnp.int32)[None, :] < new_lens[:, None]
    fresh = fresh[:, None, None]
    taps = conv_weight.shape[1] - 1
    conv_s = jnp.where(fresh, 0, jnp.swapaxes(gather_windows(conv_pool, layer, slot_ids, taps), 1, 2))
    rec_s = jnp.where(fresh[..., None], 0, rec_pool[layer, slot_ids])
    o, conv_s, rec_s = gdn_mix(mixed, conv_weight, g, beta, conv_s, rec_s, valid, new_lens, dims,
                               recurrent=t <= recurrent_max_t, chunk_rule=chunk_rule)
    if gate is not None:
        o = gated_rms_norm(o.astype(gate.dtype), gate.reshape(o.shape), norm_weight, norm_eps)
    if not commit:
        return o, conv_pool, rec_pool
    conv_pool = scatter_windows(conv_pool, layer, slot_ids, jnp.swapaxes(conv_s, 1, 2))
    return o, conv_pool, rec_pool.at[layer, slot_ids].set(rec_s)
