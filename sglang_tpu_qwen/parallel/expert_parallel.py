"""Expert-parallel MoE inside ``jax.shard_map`` (docs/internals.md, "parallel/").

Per device, for its ``N`` tokens (one micro-batch at a time):

1. route locally (router weights are replicated), pack each (weight, expert id) into one int32, and
   all-gather the tokens and the packed routing over the expert axis;
2. sort the gathered (token, slot) pairs by local expert, other devices' pairs last, and run the pairs
   that live here through the SwiGLU experts as the MoE backend's grouped matmuls (kernels/moe_backend.py:
   ``jax.lax.ragged_dot``, or the Pallas FP8 kernel, which reads each pair's token row from the gathered
   tokens itself)
   in chunks sized for the pairs expected here (``CAPACITY_FACTOR`` times ``k * E_local / E`` per gathered
   token), not for all of them: one chunk in the usual step, more only when routing is skewed;
3. scale the activations by the routing weight, add each pair's down projection into its token's row of
   the ``[n * N, H]`` partial sums (inside the Pallas FP8 kernel: no ``[pairs, H]`` product is written),
   and reduce-scatter them back to the token owners (flat or hierarchical, collectives.py);
4. add the shared expert, computed locally.

Dropless: the chunks cover every local pair, so a batch in which all tokens pick the same expert is exact.
Math of the block: HF ``Qwen3_5MoeSparseMoeBlock`` (model/moe.py).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from sglang_tpu_qwen.kernels.moe_backend import MoeBackend
from sglang_tpu_qwen.model.config import Qwen35MoeConfig
from sglang_tpu_qwen.model.moe import group_counts, route, shared_expert
from sglang_tpu_qwen.parallel.collectives import block_order, reduce_scatter


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


# Rows of one chunk of local (token, expert) pairs, as a multiple of the pairs expected here under uniform
# routing: every row of a chunk is gathered and scattered, so the factor trades bytes moved in the usual
# step against a second chunk (exact either way) on a device whose experts get over 1.5x their share.
CAPACITY_FACTOR = 1.5


def chunk_rows(pairs: int, e_local: int, num_experts: int, factor: float = CAPACITY_FACTOR) -> int:
    """Rows per chunk of :func:`local_experts` for ``pairs`` gathered (token, slot) pairs: ``factor`` times
    the ``pairs * e_local / num_experts`` expected here, rounded up to a multiple of 8 (a sublane tile), at
    most ``pairs`` (then one chunk holds every pair and the chunk loop runs once)."""
    expected = pairs * e_local / num_experts
    return min(pairs, -(-math.ceil(factor * expected) // 8) * 8)


def local_experts(
    x: jax.Array,
    weights: jax.Array,
    expert_ids: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
    first_expert: jax.Array,
    num_experts: int | None = None,
    capacity_factor: float = CAPACITY_FACTOR,
    out_rows: jax.Array | None = None,
    backend: MoeBackend | None = None,
) -> jax.Array:
    """Contribution of this device's experts to every token (zero for pairs routed elsewhere).

    The pairs routed here are sorted by local expert and run in chunks of :func:`chunk_rows` rows (a
    ``fori_loop`` with a data-dependent trip count; one chunk unless routing puts more than
    ``capacity_factor`` times the expected pairs here), so the gathered rows and the expert activations are
    sized by the pairs this device serves, not by all ``M * k`` gathered pairs. Dropless: every local pair
    is computed.

    Args:
        x: ``[M, *backend.kernel_rows(w_gate, H)]`` gathered tokens (kernels/moe_backend.py: with FP8 experts
            under ``pallas``, rows the kernel reads one DMA each, so no gathered copy of the pairs' rows is
            written).
        weights: ``[M, k]`` float32 routing weights.
        expert_ids: ``[M, k]`` int32 global expert ids.
        w_gate, w_up: ``[E_local, H, I]``; w_down: ``[E_local, I, H]``; dense or FP8 (quant/fp8.py).
        first_expert: scalar int32, global id of local expert 0.
        num_experts: E over all devices (default E_local): sizes the chunks.
        capacity_factor: chunk rows over the pairs expected here (uniform routing).
        out_rows: ``[M]`` int32, the result row each token's contributions are added into (a permutation;
            default the token's own row): the reduce-scatter's block order.
        backend: runs the grouped matmuls (kernels/moe_backend.py); None: the reference.

    Returns:
        ``[M, *backend.kernel_rows(w_down, H)]`` in ``x.dtype`` (with FP8 experts under ``pallas``
        ``[M, H / 128, 128]``, rows the kernel adds into one by one; reshaping it to ``[M, H]`` is a relayout
        on TPU, so callers reduce it first).
    """
    backend = backend or MoeBackend()
    m, k = expert_ids.shape
    e_local = w_gate.shape[0]
    num_experts = num_experts or e_local
    pairs = m * k
    rows = chunk_rows(pairs, e_local, num_experts, capacity_factor)
    n_chunks_max = -(-pairs // rows)
    expected = min(rows, -(-pairs * e_local // num_experts))  # rows a chunk fills (XLA's cost model only)
    local = expert_ids.reshape(-1) - first_expert
    here = (local >= 0) & (local < e_local)
    key = jnp.where(here, local, e_local)  # other devices' pairs sort after every local group
    order = jnp.argsort(key, stable=True)
    group_sizes = group_counts(key, e_local)  # other devices' pairs (key e_local) are not counted
    group_ends = jnp.cumsum(group_sizes)
    n_here = group_ends[-1]
    # Padded to whole chunks; padding pairs (and other devices' pairs) have routing weight 0.
    pad = n_chunks_max * rows - pairs
    token = jnp.pad(order // k, (0, pad))
    scale = jnp.pad(jnp.where(here, weights.reshape(-1), 0.0)[order], (0, pad))
    # A token's first local pair in sorted order is its smallest local expert (top-k experts are distinct):
    # that pair's product is written into the still-zero row instead of read-added (one HBM read less).
    key_tk = key.reshape(m, k)
    first = (key_tk == key_tk.min(axis=1, keepdims=True)) & here.reshape(m, k)
    overwrite = jnp.pad(first.reshape(-1)[order], (0, pad))
    # The first chunk writes a new [M, H] accumulator that nothing zeroes beforehand: the rows of tokens with
    # no local expert are zeroed by the kernel, the others are written by their first pair (a 256 MiB zero
    # fill per layer at the Ironwood prefill step, gone).
    token_rows = jnp.arange(m, dtype=jnp.int32) if out_rows is None else out_rows
    zero_rows = jnp.where(here.reshape(m, k).any(axis=1), -1, token_rows)
    # Tokens with at least one local expert, and with none, under uniform routing (XLA's cost model only).
    p_none = (1.0 - e_local / num_experts) ** k
    expected_first, expected_zero = min(expected, int(m * (1.0 - p_none))), int(m * p_none)

    def chunk(i: jax.Array, acc: jax.Array | None) -> jax.Array:
        start = i * rows
        # Each group's rows inside [start, start + rows): the window's share of the sorted groups.
        sizes = jnp.clip(group_ends - start, 0, rows) - jnp.clip(group_ends - group_sizes - start, 0, rows)
        tok = jax.lax.dynamic_slice_in_dim(token, start, rows)
        dest = tok if out_rows is None else out_rows[tok]
        # The routing weight scales the activations (the down projection is linear), as in all_experts
        # (model/moe.py): no [rows, H] product after the down projection.
        act = backend.grouped_swiglu(x, w_gate, w_up, sizes, jax.lax.dynamic_slice_in_dim(scale, start, rows),
                                     row_ids=tok, expected_rows=expected, zero_tail=False)
        # The down projection adds each pair's row into its token's row (rows past the groups are skipped).
        return backend.grouped_scatter_add(act, w_down, sizes, dest, acc,
                                           jax.lax.dynamic_slice_in_dim(overwrite, start, rows),
                                           zero_rows if acc is None else None, num_rows=m, expected_rows=expected,
                                           expected_overwrites=expected_first, expected_zero_rows=expected_zero)

    # Summed in x.dtype, as HF's index_add_ into a hidden-dtype buffer (and the reduce-scatter after it).
    acc = chunk(jnp.int32(0), None)
    if n_chunks_max == 1:
        return acc
    # The first chunk is outside the loop: in the usual step (one chunk) the [M, H] sums are written by its
    # scatter and not carried through a loop (a loop-carried buffer was copied every layer: 0.5 GiB in the
    # Ironwood prefill step). Skewed routing runs the rest under the cond.
    n_chunks = -(-n_here // rows)
    return jax.lax.cond(n_chunks > 1, lambda a: jax.lax.fori_loop(1, n_chunks, chunk, a), lambda a: a, acc)


def ep_moe_tokens(
    p: dict[str, Any],
    x: jax.Array,
    config: Qwen35MoeConfig,
    *,
    axis_name: str,
    axis_size: int,
    combine: str = "hierarchical",
    micro_batches: int = 1,
    backend: MoeBackend | None = None,
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
        backend: runs the expert and shared-expert matmuls (kernels/moe_backend.py); None: the reference.

    Returns:
        ``[N, H]`` in ``x.dtype``.
    """
    backend = backend or MoeBackend()
    n_tok = x.shape[0]
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
        # Two gathers, each array in its own dtype: packing the tokens' bits into the routing's int32
        # words (one collective) gave the gathered tokens a non-native bf16 tiling, and XLA relaid out
        # the [n * N_mb, H] array every layer (measured on the Ironwood prefill step: 2 GiB per layer).
        # In the rows the gate/up kernel reads by DMA (kernel_rows): only this device's N_mb rows are relaid out.
        rows = chunk.reshape(chunk.shape[0], *backend.kernel_rows(p["w_gate"], chunk.shape[1]))
        gx = jax.lax.all_gather(rows, axis_name, axis=0, tiled=True)  # [n * N_mb, *kernel_rows]
        packed = jax.lax.all_gather(pack_routing(w, ids, e), axis_name, axis=0, tiled=True)
        gw, gids = unpack_routing(packed, e)
        # Each token's sums go straight to the row the combine expects (its device's block in block_order).
        n_mb = chunk.shape[0]
        gathered = jnp.arange(axis_size * n_mb, dtype=jnp.int32)
        out_rows = jnp.asarray(block_order(combine, axis_size))[gathered // n_mb] * n_mb + gathered % n_mb
        y = local_experts(gx, gw, gids, p["w_gate"], p["w_up"], p["w_down"], first, e, out_rows=out_rows,
                          backend=backend)
        # Reduced in the row-tiled shape; only this device's N_mb rows are relaid out to [N_mb, H].
        outs.append(reduce_scatter(y, axis_name, axis_size, combine).reshape(chunk.shape[0], -1))
    routed = jnp.concatenate(outs, axis=0)[:n_tok]
    shared = shared_expert(p, x, backend)
    return (routed + shared).astype(x.dtype)


def make_ep_moe_fn(
    axis_name: str,
    axis_size: int,
    *,
    tokens_replicated: bool,
    combine: str = "hierarchical",
    micro_batches: int = 1,
) -> Any:
    """A ``moe_fn(p, x [..., H], config, backend=None) -> [..., H]`` for ``forward_step`` running inside
    ``shard_map``; ``backend`` is the MoE backend ``forward_step`` passes (its ``backends.moe``; None: the
    reference).

    ``tokens_replicated``: every device of the expert axis holds the same tokens (attention replicated over
    it, e.g. dp1-ep8): each device then takes a 1/n slice, runs :func:`ep_moe_tokens`, and the slices are
    all-gathered back. Otherwise each device's tokens are its own (DP attention over the expert axis).
    """

    def moe_fn(p: dict[str, Any], x: jax.Array, config: Qwen35MoeConfig,
               backend: MoeBackend | None = None) -> jax.Array:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        kw = dict(axis_name=axis_name, axis_size=axis_size, combine=combine, micro_batches=micro_batches,
                  backend=backend)
        if not tokens_replicated:
            return ep_moe_tokens(p, flat, config, **kw).reshape(shape)
        n = flat.shape[0]
        per = -(-n // axis_size)
        padded = jnp.pad(flat, ((0, per * axis_size - n), (0, 0)))
        mine = jax.lax.dynamic_slice_in_dim(padded, jax.lax.axis_index(axis_name) * per, per)
        out = ep_moe_tokens(p, mine, config, **kw)
        return jax.lax.all_gather(out, axis_name, axis=0, tiled=True)[:n].reshape(shape)

    return moe_fn
