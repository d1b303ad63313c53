"""Expert-parallel MoE inside ``jax.shard_map`` (DESIGN.md section 4).

Per device, for its ``N`` tokens (one micro-batch at a time):

1. route locally (router weights are replicated), pack each (weight, expert id) into one int32 and the
   tokens' bits beside them, and all-gather that single int32 array over the expert axis (one collective);
2. keep the (token, slot) pairs whose expert lives here, sort them by local expert and run the SwiGLU
   experts as grouped matmuls (``jax.lax.ragged_dot``); rows of other devices' experts sort last, outside
   every group, and come out as zeros;
3. scale by the routing weight, sum each token's contributions, and reduce-scatter the ``[n * N, H]``
   partial sums back to the token owners (flat or hierarchical, collectives.py);
4. add the shared expert, computed locally.

Dropless: the grouped matmul has room for every gathered (token, slot) pair, so a batch in which all
tokens pick the same expert is exact. Math of the block: HF ``Qwen3_5MoeSparseMoeBlock`` (model/moe.py).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from sglang_tpu_qwen.model.config import Qwen35MoeConfig
from sglang_tpu_qwen.model.moe import route, shared_expert
from sglang_tpu_qwen.parallel.collectives import reduce_scatter
from sglang_tpu_qwen.parallel.fp8 import grouped


def _id_bits(num_experts: int) -> int:
    return max(1, (num_experts - 1).bit_length())


def pack_routing(weights: jax.Array, expert_ids: jax.Array, num_experts: int) -> jax.Array:
    """Routing weight (float32 bits) with the expert id in its low mantissa bits.

    Args:
        weights: ``[N, k]`` in ``[0, 1]``, any float dtype.
        expert_ids: ``[N, k]`` int32 in ``[0, num_experts)``.
        num_experts: E; the id takes ``ceil(log2 E)`` bits (9 for 512).

    Returns:
        ``[N, k]`` int32. Lossless for bfloat16 weights (their low 16 float32 bits are zero) when
        E <= 65536; for float32 weights the relative error is below ``2 ** -(23 - bits)``.
    """
    mask = (1 << _id_bits(num_experts)) - 1
    w_bits = jax.lax.bitcast_convert_type(weights.astype(jnp.float32), jnp.int32)
    return (w_bits & ~mask) | expert_ids.astype(jnp.int32)


def unpack_routing(packed: jax.Array, num_experts: int) -> tuple[jax.Array, jax.Array]:
    """Inverse of :func:`pack_routing`: ``(weights [N, k] float32, expert ids [N, k] int32)``."""
    mask = (1 << _id_bits(num_experts)) - 1
    return jax.lax.bitcast_convert_type(packed & ~mask, jnp.float32), packed & mask


def _to_words(x: jax.Array) -> jax.Array:
    """``[N, H]`` 2- or 4-byte floats -> ``[N, H * itemsize / 4]`` int32 (bit copy)."""
    n, h = x.shape
    per_word = 4 // x.dtype.itemsize
    return jax.lax.bitcast_convert_type(x.reshape(n, h // per_word, per_word), jnp.int32).reshape(n, -1)


def _from_words(w: jax.Array, dtype: Any, h: int) -> jax.Array:
    per_word = 4 // jnp.dtype(dtype).itemsize
    x = jax.lax.bitcast_convert_type(w, dtype)
    return x.reshape(w.shape[0], h) if per_word > 1 else x


def local_experts(
    x: jax.Array,
    weights: jax.Array,
    expert_ids: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
    first_expert: jax.Array,
    num_experts: int | None = None,
) -> jax.Array:
    """Contribution of this device's experts to every token (zero for pairs routed elsewhere).

    Args:
        x: ``[M, H]`` gathered tokens.
        weights: ``[M, k]`` float32 routing weights.
        expert_ids: ``[M, k]`` int32 global expert ids.
        w_gate, w_up: ``[E_local, H, I]``; w_down: ``[E_local, I, H]``; dense or FP8 (parallel/fp8.py).
        first_expert: scalar int32, global id of local expert 0.
        num_experts: E over all devices (default E_local); only XLA's cost model of the FP8 kernel uses it.

    Returns:
        ``[M, H]`` float32.
    """
    m, k = expert_ids.shape
    e_local = w_gate.shape[0]
    num_experts = num_experts or e_local
    local = expert_ids.reshape(-1) - first_expert
    here = (local >= 0) & (local < e_local)
    key = jnp.where(here, local, e_local)  # other devices' pairs sort after every local group
    order = jnp.argsort(key, stable=True)
    xs = x[order // k]
    group_sizes = jnp.bincount(key, length=e_local + 1)[:e_local].astype(jnp.int32)
    # Of the M * k gathered pairs, E_local / E are expected here (uniform routing; XLA's cost model only).
    here_rows = -(-m * k * e_local // num_experts)
    gate = grouped(xs, w_gate, group_sizes, expected_rows=here_rows)
    up = grouped(xs, w_up, group_sizes, expected_rows=here_rows)
    ys = grouped(jax.nn.silu(gate) * up, w_down, group_sizes, out_dtype=jnp.float32, expected_rows=here_rows)
    scale = jnp.where(here, weights.reshape(-1), 0.0)[order]
    return jnp.zeros((m, ys.shape[-1]), jnp.float32).at[order // k].add(ys * scale[:, None])


def ep_moe_tokens(
    p: dict[str, Any],
    x: jax.Array,
    config: Qwen35MoeConfig,
    *,
    axis_name: str,
    axis_size: int,
    combine: str = "hierarchical",
    micro_batches: int = 1,
) -> jax.Array:
    """The MoE block for this device's tokens; call inside ``shard_map`` with experts split over ``axis_name``.

    Args:
        p: MOE params (docs/internals.md) with ``w_gate``/``w_up``/``w_down`` holding this device's
            ``E / axis_size`` experts (device ``i`` holds experts ``[i*E/n, (i+1)*E/n)``), the rest replicated.
        x: ``[N, H]`` this device's tokens (float32 or bfloat16). N is padded up to a multiple of
            ``micro_batches`` internally.
        config: model config.
        axis_name: expert mesh axis; axis_size: its size (static).
        combine: ``"flat"`` or ``"hierarchical"`` reduce-scatter.
        micro_batches: split the tokens into this many independent dispatch/compute/combine rounds, so the
            combine of one can overlap the compute of the next.

    Returns:
        ``[N, H]`` in ``x.dtype``.
    """
    n_tok, h = x.shape
    e = config.num_experts
    e_local = p["w_gate"].shape[0]
    if e_local * axis_size != e:
        raise ValueError(f"{e} experts do not split into {axis_size} shards of {e_local}")
    first = jax.lax.axis_index(axis_name) * e_local
    mb = max(1, micro_batches)
    pad = -n_tok % mb
    xp = jnp.pad(x, ((0, pad), (0, 0)))
    outs = []
    for chunk in jnp.split(xp, mb):
        w, ids = route(chunk, p["router"], config.num_experts_per_tok, config.norm_topk_prob)
        words = jnp.concatenate([_to_words(chunk), pack_routing(w, ids, e)], axis=1)
        g = jax.lax.all_gather(words, axis_name, axis=0, tiled=True)  # [n * N_mb, W]
        hw = g.shape[1] - ids.shape[1]
        gw, gids = unpack_routing(g[:, hw:], e)
        gx = _from_words(g[:, :hw], x.dtype, h)
        y = local_experts(gx, gw, gids, p["w_gate"], p["w_up"], p["w_down"], first, e)
        outs.append(reduce_scatter(y.astype(x.dtype), axis_name, axis_size, combine))
    routed = jnp.concatenate(outs, axis=0)[:n_tok]
    shared = shared_expert(p, x)
    return (routed + shared).astype(x.dtype)


def make_ep_moe_fn(
    axis_name: str,
    axis_size: int,
    *,
    tokens_replicated: bool,
    combine: str = "hierarchical",
    micro_batches: int = 1,
) -> Any:
    """A ``moe_fn(p, x [..., H], config) -> [..., H]`` for ``forward_step`` running inside ``shard_map``.

    ``tokens_replicated``: every device of the expert axis holds the same tokens (attention replicated over
    it, e.g. dp1-ep8): each device then takes a 1/n slice, runs :func:`ep_moe_tokens`, and the slices are
    all-gathered back. Otherwise each device's tokens are its own (DP attention over the expert axis).
    """

    def moe_fn(p: dict[str, Any], x: jax.Array, config: Qwen35MoeConfig) -> jax.Array:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        kw = dict(axis_name=axis_name, axis_size=axis_size, combine=combine, micro_batches=micro_batches)
        if not tokens_replicated:
            return ep_moe_tokens(p, flat, config, **kw).reshape(shape)
        n = flat.shape[0]
        per = -(-n // axis_size)
        padded = jnp.pad(flat, ((0, per * axis_size - n), (0, 0)))
        mine = jax.lax.dynamic_slice_in_dim(padded, jax.lax.axis_index(axis_name) * per, per)
        out = ep_moe_tokens(p, mine, config, **kw)
        return jax.lax.all_gather(out, axis_name, axis=0, tiled=True)[:n].reshape(shape)

    return moe_fn
