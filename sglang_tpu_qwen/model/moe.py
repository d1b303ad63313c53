"""Sparse MoE block: softmax top-k router, routed SwiGLU experts, sigmoid-gated shared expert.

Math follows HF ``Qwen3_5MoeSparseMoeBlock``. Routed experts run as a grouped matmul: the (token, slot)
pairs are sorted by expert id and fed to the MoE backend's FFN (kernels/moe_backend.py ``MoeBackend.ffn``:
``jax.lax.ragged_dot``, kernels/grouped_ffn at prefill and verify-sized steps, or the Pallas block-FP8 kernel)
with per-expert group sizes; programs for XLA:CPU compute dense experts densely instead (:func:`all_experts`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from sglang_tpu_qwen.kernels.moe_backend import MoeBackend
from sglang_tpu_qwen.model.config import Qwen35MoeConfig
from sglang_tpu_qwen.quant.fp8 import Fp8Weight


def route(x: jax.Array, router: jax.Array, top_k: int, norm_topk_prob: bool) -> tuple[jax.Array, jax.Array]:
    """Softmax router (in float32) with top-k selection.

    Args:
        x: ``[N, H]`` tokens.
        router: ``[H, E]`` router weight.
        top_k: experts per token.
        norm_topk_prob: renormalise the top-k probabilities to sum to 1.

    Returns:
        ``(weights [N, k] in x.dtype, expert ids [N, k] int32)``.
    """
    logits = x @ router
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    top_w, top_i = jax.lax.top_k(probs, top_k)
    if norm_topk_prob:
        top_w = top_w / jnp.sum(top_w, axis=-1, keepdims=True)
    return top_w.astype(x.dtype), top_i.astype(jnp.int32)


def group_counts(ids: jax.Array, num_groups: int) -> jax.Array:
    """``[num_groups]`` int32: how many of ``ids [M]`` (int32) equal each group id in ``[0, num_groups)``; other
    values are not counted. A compare-and-sum, which XLA fuses into one reduce over ``[num_groups, M]``:
    ``jnp.bincount`` is a scatter-add, which the v5e runs an element at a time (0.14 ms a MoE layer at 16,384
    (token, expert) pairs in the prefill profile, 2.8% of the prefill)."""
    return jnp.sum(ids[None, :] == jnp.arange(num_groups, dtype=ids.dtype)[:, None], axis=1, dtype=jnp.int32)


def routed_experts(
    x: jax.Array,
    weights: jax.Array,
    expert_ids: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
    backend: MoeBackend | None = None,
) -> jax.Array:
    """Weighted sum of each token's top-k SwiGLU experts via sort-by-expert + grouped matmuls.

    Args:
        x: ``[N, H]``.
        weights: ``[N, k]`` routing weights.
        expert_ids: ``[N, k]`` int32 in ``[0, E)``.
        w_gate, w_up: ``[E, H, I]``.
        w_down: ``[E, I, H]``. Each dense or a :class:`quant.fp8.Fp8Weight` stack.
        backend: runs the grouped matmuls (kernels/moe_backend.py); None: the reference.

    Returns:
        ``[N, H]`` in ``x.dtype``.
    """
    backend = backend or MoeBackend()
    n, k = expert_ids.shape
    num_experts = w_gate.shape[0]
    flat = expert_ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    tokens = order // k
    xs = x[tokens]  # [N*k, H], grouped by expert
    group_sizes = group_counts(flat, num_experts)
    ys = backend.ffn(xs, w_gate, w_up, w_down, group_sizes, expected_rows=n * k)  # [N*k, H]
    ys = ys * weights.reshape(-1)[order][:, None]
    # Undo the sort (a permutation) by a row gather, then sum each token's k contributions. A scatter of the
    # rows (``.at[order].set``) wrote each [H] row as one sublane of every tile it crossed: 0.1 ms a layer at
    # 256 decode rows of the 35B layout on the v5e, where the forward gather of the same rows took 0.03 ms.
    # The inverse permutation by a second sort, not a scatter (``.at[order].set(arange)``): the v5e runs a
    # scatter an element at a time, 76 us a layer at 16,384 pairs in the prefill profile, where the argsort
    # above took 12 us.
    inverse = jnp.argsort(order)
    out = ys[inverse]
    return out.reshape(n, k, -1).sum(axis=1).astype(x.dtype)


def all_experts(
    x: jax.Array,
    weights: jax.Array,
    expert_ids: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
) -> jax.Array:
    """:func:`routed_experts` computed densely: every expert on every token, weighted by a [N, E] routing
    matrix that is zero outside each token's top-k.

    E / k times the routed flops, but no sort, gather or scatter. For XLA:CPU only, whose `ragged_dot`
    expands to a masked dense product over all E groups for every gathered row (E * N * k rows: measured
    2.5x this form's time at E = 12, and linear in E). The routing weights scale the SwiGLU activations
    (the down projection is linear), so the down projection and the combine are one [N, E*I] x [E*I, H]
    product: 2.3x faster at N = 512 than weighting each expert's [N, H] output (measured on the 2-core
    CPU). Same arguments and result as routed_experts (up to float summation order); the weights must be
    dense arrays.
    """
    n = x.shape[0]
    combine = jnp.zeros((n, w_gate.shape[0]), weights.dtype).at[jnp.arange(n)[:, None], expert_ids].add(weights)
    gate = jnp.einsum("nh,ehi->nei", x, w_gate)
    up = jnp.einsum("nh,ehi->nei", x, w_up)
    act = jax.nn.silu(gate) * up * combine[:, :, None].astype(gate.dtype)
    return jnp.einsum("nei,eih->nh", act, w_down).astype(x.dtype)


def shared_expert(p: dict[str, Any], x: jax.Array, backend: MoeBackend | None = None) -> jax.Array:
    """``sigmoid(x @ shared_expert_gate) * SwiGLU(x)`` of the shared expert: ``x [N, H]`` -> ``[N, H]``; its
    projections through ``backend.linear`` (None: the reference)."""
    linear = (backend or MoeBackend()).linear
    shared = linear(jax.nn.silu(linear(x, p["shared_gate"])) * linear(x, p["shared_up"]), p["shared_down"])
    return jax.nn.sigmoid(x @ p["shared_expert_gate"]) * shared


def moe_block(p: dict[str, Any], x: jax.Array, config: Qwen35MoeConfig, backend: MoeBackend | None = None, *,
              dense: bool = False) -> jax.Array:
    """Routed experts plus ``sigmoid(x @ shared_expert_gate) * shared_expert(x)``.

    Args:
        p: ``{"router", "w_gate", "w_up", "w_down", "shared_gate", "shared_up", "shared_down",
            "shared_expert_gate"}`` (see docs/internals.md).
        x: ``[..., H]`` normalised hidden states.
        config: model config (``num_experts_per_tok``, ``norm_topk_prob``).
        backend: the MoE backend (kernels/moe_backend.py) that runs the expert and shared-expert matmuls;
            None: the reference.
        dense: compute the routed experts with :func:`all_experts` (programs for XLA:CPU; ignored when
            the expert weights are FP8).

    Returns:
        ``[..., H]`` in ``x.dtype``.
    """
    shape = x.shape
    x = x.reshape(-1, shape[-1])
    w, ids = route(x, p["router"], config.num_experts_per_tok, config.norm_topk_prob)
    if dense and not isinstance(p["w_gate"], Fp8Weight):
        routed = all_experts(x, w, ids, p["w_gate"], p["w_up"], p["w_down"])
    else:
        routed = routed_experts(x, w, ids, p["w_gate"], p["w_up"], p["w_down"], backend)
    shared = shared_expert(p, x, backend)
    return (routed + shared).reshape(shape)
