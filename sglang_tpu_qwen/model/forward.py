"""One batched model step over the paged KV cache and the GDN state slots (contract: docs/internals.md).

Decoder layer (HF ``Qwen3_5MoeDecoderLayer`` / ``Qwen3_5DecoderLayer`` / ``Qwen3NextDecoderLayer``)::

    h = h + mixer(rms_norm(h))        mixer: Gated DeltaNet or gated attention, per layer_types
    h = h + mlp(rms_norm(h))          mlp: sparse MoE or dense SwiGLU, per mlp_types

The layers run under one ``jax.lax.scan`` over groups of one layer period (model/stacking.py: 3 GDN +
1 attention for Qwen3.5), so the compiled program holds each layer kind once whatever the depth; the
server, the tests and the planner (tools/plan/) all compile this function.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from sglang_tpu_qwen.kernels.dispatch import KernelBackends
from sglang_tpu_qwen.kernels.gdn.delta_rule import gdn_mix
from sglang_tpu_qwen.kernels.gdn.slot_copy import copy_slots
from sglang_tpu_qwen.kernels.gdn.state_layout import GDN_STATE_LAYOUT, GdnStateLayout
from sglang_tpu_qwen.kernels.ragged_paged_attention.layout import KVPoolLayout
from sglang_tpu_qwen.kernels.ragged_paged_attention.token_major import TOKEN_MAJOR
from sglang_tpu_qwen.model.attention import attention_layer
from sglang_tpu_qwen.model.config import Qwen35MoeConfig
from sglang_tpu_qwen.model.dense_mlp import dense_mlp
from sglang_tpu_qwen.model.forward_batch import ForwardBatch
from sglang_tpu_qwen.model.gated_deltanet import (
    gdn_layer_on_pools,
    gdn_layer_pooled,
    gdn_layer_verify,
    gdn_layer_verify_pooled,
    slot_states,
    write_slot_states,
)
from sglang_tpu_qwen.model.moe import moe_block
from sglang_tpu_qwen.model.norms import rms_norm
from sglang_tpu_qwen.model.rope import mrope_cos_sin, rope_cos_sin
from sglang_tpu_qwen.quant.fp8 import join_layer_fp8, split_stacked_fp8

Params = dict[str, Any]
Cache = dict[str, jax.Array]


def init_cache(
    config: Qwen35MoeConfig,
    num_pages: int,
    page_size: int,
    num_slots: int,
    kv_dtype: Any,
    state_dtype: Any = jnp.float32,
    mtp_layers: int = 0,
    *,
    kv_layout: KVPoolLayout = TOKEN_MAJOR,
    state_layout: GdnStateLayout = GDN_STATE_LAYOUT,
) -> Cache:
    """Zeroed cache for all layers.

    ``mtp_layers``: the KV pool also holds that many MTP layers' pages, after the target's attention layers
    (layer index ``config.num_attn_layers + i``, model/mtp.py): the MTP layer's KV follows the page table, and
    so the radix tree, with the target's. ``kv_layout`` / ``state_layout``: how the pools are stored, the
    attention and GDN backends' (``KernelBackends.attention.layout`` / ``.gdn.state_layout``); every later
    reader of the cache must be given the same ones.

    Returns:
        ``{"k", "v": kv_layout.pool_shape(n_attn_layers + mtp_layers, num_pages, page_size, nkv, hd, kv_dtype)
        kv_dtype (logically [L, num_pages, page_size, nkv, hd]; kernels/ragged_paged_attention/layout.py),
        "conv": [n_gdn_layers, num_slots * (K-1), conv_dim / 128, 128] and "rec": [n_gdn_layers, num_slots, Hv, dk, dv]
        state_dtype (kernels/gdn/state_layout.py)}``. Page 0 and slot 0 are trash targets.

    Raises:
        ValueError: ``page_size`` does not fit ``kv_layout`` for ``kv_dtype`` (e.g. FP8 packing).
    """
    kv_shape = kv_layout.pool_shape(config.num_attn_layers + mtp_layers, num_pages, page_size,
                                    config.num_key_value_heads, config.head_dim, kv_dtype)
    conv_shape = state_layout.conv_shape(config.num_gdn_layers, num_slots, config.gdn_conv_dim,
                                         config.linear_conv_kernel_dim - 1)
    rec_shape = state_layout.rec_shape(config.num_gdn_layers, num_slots, config.linear_num_value_heads,
                                       config.linear_key_head_dim, config.linear_value_head_dim)
    return {
        "k": jnp.zeros(kv_shape, kv_dtype),
        "v": jnp.zeros(kv_shape, kv_dtype),
        "conv": jnp.zeros(conv_shape, state_dtype),
        "rec": jnp.zeros(rec_shape, state_dtype),
    }


def forward_step(
    params: Params,
    cache: Cache,
    batch: ForwardBatch,
    *,
    config: Qwen35MoeConfig,
    moe_fn: Callable[..., jax.Array] | None = None,
    backends: KernelBackends | None = None,
) -> tuple[jax.Array, Cache] | tuple[jax.Array, Cache, GdnInputs]:
    """Run the new tokens of a batch of sequences through the model, updating the cache.

    Args:
        params: parameter pytree (docs/internals.md), layers stacked (model/stacking.py); FP8 leaves
            (quant/fp8.py) allowed for the quantised linear weights.
        cache: from :func:`init_cache`.
        batch: the step (model/forward_batch.py): ``input_ids [B, T]``, ``prefix_lens``, ``extend_lens``,
            ``slot_ids [B]`` and ``page_table [B, P]``, int32; its ``token_src`` is not read. ``T == 1`` uses
            the recurrent GDN form, ``T > 1`` the chunked one. A ``TARGET_VERIFY`` batch (speculative
            decoding) writes the KV of every token but leaves the GDN slots as they were, and also returns the
            GDN layers' inputs, so that :func:`commit_gdn_states` can advance each slot over the tokens that
            were accepted (state rollback by recomputing the recurrence from the pre-verify state).
        config: static model config.
        moe_fn: ``(moe_params, x [B, T, H], config, backend) -> [B, T, H]``, ``backend`` the MoE backend
            (``backends.moe``, kernels/moe_backend.py); default :func:`moe_block`. The expert-parallel path
            (parallel/expert_parallel.py) passes its own inside ``shard_map``. Dense MLP layers ignore it (their
            weights are whole on every device).
        backends: static kernel choice per layer kind and target platform (``kernels.dispatch``); None = the
            jnp reference in its accelerator forms. ``backends.moe`` runs the experts' grouped matmuls and every
            linear layer's matmul (dense or block-FP8).

    Returns:
        ``(hidden [B, T, H] after the final norm in the compute dtype, new cache)``, plus the
        :data:`GdnInputs` of a ``TARGET_VERIFY`` batch. Hidden rows of padded tokens are finite but meaningless.
    """
    period = len(params["layers"])
    kinds = config.layer_types[:period]
    n_attn = sum(k == "full_attention" for k in kinds)
    n_gdn = period - n_attn
    rope = rope_tables(batch, config)
    layer = functools.partial(decoder_layer, batch=batch, rope=rope, config=config, backends=backends,
                              moe_fn=moe_fn)
    verify = batch.mode.is_verify

    # FP8 weights stay whole stacks outside the scan: the kernel reads layer g in place (quant/fp8.py).
    scanned, fp8_stacks = split_stacked_fp8(params["layers"])

    def group(carry: tuple[jax.Array, ...], xs: tuple[jax.Array, list[Params]]) -> tuple[tuple[jax.Array, ...], Any]:
        h, *pools = carry
        g, lps = xs
        lps = join_layer_fp8(lps, fp8_stacks, g)
        # Cache index of this group's first layer of each kind (traced: the kernels take it in SMEM).
        attn_i, gdn_i = g * n_attn, g * n_gdn
        saved = []
        for kind, lp in zip(kinds, lps, strict=True):
            index = attn_i if kind == "full_attention" else gdn_i
            h, pools, inputs = layer(lp, kind, h, tuple(pools), index)
            if inputs is not None:
                saved.append(inputs)
            attn_i, gdn_i = (attn_i + 1, gdn_i) if kind == "full_attention" else (attn_i, gdn_i + 1)
        return (h, *pools), (tuple(saved) if verify else None)

    n_groups = config.num_hidden_layers // period
    carry = (embed_tokens(params["embed"], batch, config), cache["k"], cache["v"], cache["conv"], cache["rec"])
    (h, k_cache, v_cache, conv, rec), saved = jax.lax.scan(
        group, carry, (jnp.arange(n_groups, dtype=jnp.int32), scanned)
    )
    h = rms_norm(h, params["final_norm"], config.rms_norm_eps)
    new_cache = {"k": k_cache, "v": v_cache, "conv": conv, "rec": rec}
    return (h, new_cache, saved) if verify else (h, new_cache)


# A TARGET_VERIFY step's GDN layer inputs: per GDN position j of the layer period, (mixed [G, B, T, conv_dim]
# compute dtype, g [G, B, T, Hv] float32, beta [G, B, T, Hv] float32), G the layer groups (model/stacking.py).
GdnInputs = tuple[tuple[jax.Array, jax.Array, jax.Array], ...]


def commit_gdn_states(params: Params, cache: Cache, batch: ForwardBatch, saved: GdnInputs, commit_lens: jax.Array,
                      snap_ids: jax.Array, *, config: Qwen35MoeConfig,
                      backends: KernelBackends | None = None) -> Cache:
    """Advance each row's GDN state over the first ``commit_lens[b]`` tokens of a ``TARGET_VERIFY`` step.

    The verify step left the slots at the state before its tokens and returned its GDN layers' inputs
    (``saved``, :func:`forward_step`); this runs the causal conv1d and the gated delta rule again over the
    accepted tokens only (token by token, no weight but the conv kernels read) and writes the result, so the
    slot holds exactly the state after the last accepted token (rejected draft tokens never touch it). The same
    state is also written to slot ``snap_ids[b]`` (the prefix cache's decode snapshot, taken where the accepted
    run ends on a page boundary; 0, the trash slot, elsewhere).

    With the Pallas GDN backend each layer is one ``fused_gdn`` call over the saved inputs with ``new_lens =
    commit_lens`` (its recurrent form for a verify step's few tokens, the verify step's arithmetic token for
    token), updating each row's slot in place; then one ``copy_slots`` call (kernels/gdn/slot_copy.py) copies
    the rows that take a snapshot, all layers, slot to slot by DMA. Otherwise the jnp recurrence over gathered
    states (``gdn_mix``, recurrent) and scatters.

    Args:
        params, config: as :func:`forward_step` (reads each GDN layer's ``conv1d``).
        cache: after the verify step; ``conv`` / ``rec`` updated.
        batch: the verify step's batch (its ``slot_ids``, ``prefix_lens``).
        saved: the verify step's :data:`GdnInputs`.
        commit_lens: ``[B]`` int32 in ``[0, extend_lens[b]]``: tokens of row b to keep (0: the state stays).
        snap_ids: ``[B]`` int32 slot ids (rank-local, as ``slot_ids``).
        backends: as :func:`forward_step` (its ``gdn`` backend picks the path above).

    Returns:
        The cache with the rows' GDN slots advanced and the snapshots written.
    """
    period = len(params["layers"])
    kinds = config.layer_types[:period]
    gdn_pos = [j for j, k in enumerate(kinds) if k != "full_attention"]
    n_gdn = len(gdn_pos)
    t = batch.num_tokens
    valid = jnp.arange(t, dtype=jnp.int32)[None, :] < commit_lens[:, None]
    keep = dataclasses.replace(batch, extend_lens=commit_lens)
    snap = dataclasses.replace(batch, slot_ids=snap_ids)
    kernel = None if backends is None else backends.gdn.kernel

    def fused_group(carry: tuple[jax.Array, jax.Array], xs: Any) -> tuple[tuple[jax.Array, jax.Array], None]:
        conv, rec = carry
        g, weights, inputs = xs
        for j, (w, (mixed, gg, beta)) in enumerate(zip(weights, inputs, strict=True)):
            # Tokens past the commit are padding now (the kernel zeroes their k): zero decay and write strength.
            gg, beta = (jnp.where(valid[..., None], a, 0.0) for a in (gg, beta))
            _, conv, rec = kernel(mixed, w, gg, beta, conv, rec, g * n_gdn + j, batch.slot_ids, commit_lens,
                                  batch.fresh, num_k_heads=config.linear_num_key_heads,
                                  head_k_dim=config.linear_key_head_dim, head_v_dim=config.linear_value_head_dim)
        return (conv, rec), None

    def group(carry: tuple[jax.Array, jax.Array], xs: Any) -> tuple[tuple[jax.Array, jax.Array], None]:
        conv, rec = carry
        g, weights, inputs = xs
        for j, (w, (mixed, gg, beta)) in enumerate(zip(weights, inputs, strict=True)):
            layer = g * n_gdn + j
            conv_s, rec_s = slot_states(keep, conv, rec, layer, config)
            # Tokens past the commit are padding now: zero decay and write strength leave the state as it is.
            gg, beta = (jnp.where(valid[..., None], a, 0.0) for a in (gg, beta))
            _, conv_s, rec_s = gdn_mix(mixed, w, gg, beta, conv_s, rec_s, valid, commit_lens, config, recurrent=True)
            conv, rec = write_slot_states(snap, conv, rec, layer, conv_s, rec_s)
            conv, rec = write_slot_states(keep, conv, rec, layer, conv_s, rec_s)
        return (conv, rec), None

    weights = tuple(params["layers"][j]["gdn"]["conv1d"] for j in gdn_pos)
    n_groups = config.num_hidden_layers // period
    (conv, rec), _ = jax.lax.scan(group if kernel is None else fused_group, (cache["conv"], cache["rec"]),
                                  (jnp.arange(n_groups, dtype=jnp.int32), weights, saved))
    if kernel is not None:
        conv, rec = copy_slots(conv, rec, batch.slot_ids, snap_ids, taps=config.linear_conv_kernel_dim - 1,
                               interpret=backends.gdn.interpret)
    return {**cache, "conv": conv, "rec": rec}


Pools = tuple[jax.Array, jax.Array, jax.Array, jax.Array]


def decoder_layer(
    lp: Params,
    kind: str,
    h: jax.Array,
    pools: Pools,
    index: jax.Array | int,
    *,
    batch: ForwardBatch,
    rope: tuple[jax.Array, jax.Array],
    config: Qwen35MoeConfig,
    backends: KernelBackends | None = None,
    moe_fn: Callable[..., jax.Array] | None = None,
) -> tuple[jax.Array, Pools, tuple[jax.Array, jax.Array, jax.Array] | None]:
    """One decoder layer (HF ``Qwen3_5MoeDecoderLayer``): ``h + mixer(norm(h))``, then ``+ mlp(norm(h))``.

    Args:
        lp: the layer's params (``input_norm``, ``post_attn_norm``, ``attn`` or ``gdn``, ``moe`` or ``mlp``).
        kind: ``full_attention`` or ``linear_attention``.
        h: ``[B, T, H]`` residual stream in the compute dtype.
        pools: ``(k, v, conv, rec)`` cache pools (model/forward.py ``init_cache``).
        index: the layer's index among its kind's layers in the pools (traced or static).
        batch, rope: the step and its rotary tables (:func:`rope_tables`).
        config, backends, moe_fn: as :func:`forward_step`.

    Returns:
        ``(h [B, T, H], pools, gdn_inputs)``: this layer's KV or GDN state written; for a GDN layer in a
        ``TARGET_VERIFY`` step the state is not written and ``gdn_inputs`` is its ``(mixed, g, beta)``
        (:func:`commit_gdn_states`), else None.
    """
    k_cache, v_cache, conv, rec = pools
    backends = backends or KernelBackends()
    eps = config.rms_norm_eps
    x = rms_norm(h, lp["input_norm"], eps)
    inputs = None
    matmul = backends.moe  # every linear layer's matmul, dense or block-FP8 (kernels/moe_backend.py)
    # The named scopes ("attention", "gdn", "moe", "mlp"; "lm_head" in compute_logits) reach the compiled HLO's
    # op_name metadata: a profile's ops are grouped by them (bench/decode_step.py).
    with jax.named_scope("attention" if kind == "full_attention" else "gdn"):
        if kind == "full_attention":
            x, k_cache, v_cache = attention_layer(lp["attn"], x, batch, rope, k_cache, v_cache, index, config,
                                                  backends.attention, matmul)
        elif batch.mode.is_verify and (gdn_fused := backends.gdn.kernel) is not None:
            # The fused kernel without commit: each slot read once, nothing written (commit_gdn_states writes).
            x, inputs = gdn_layer_verify_pooled(lp["gdn"], x, batch, conv, rec, index, config, gdn_fused, matmul)
        elif batch.mode.is_verify:  # the jnp reference over the slot states, which stay as they are
            x, inputs = gdn_layer_verify(lp["gdn"], x, batch, conv, rec, index, config, backends.xla_cpu, matmul)
        elif (gdn_fused := backends.gdn.kernel) is not None:
            x, conv, rec = gdn_layer_pooled(lp["gdn"], x, batch, conv, rec, index, config, gdn_fused, matmul)
        else:
            x, conv, rec = gdn_layer_on_pools(lp["gdn"], x, batch, conv, rec, index, config, backends.xla_cpu,
                                              matmul)
    h = h + x
    x = rms_norm(h, lp["post_attn_norm"], eps)
    # A layer holds "moe" or "mlp" (model/param_layout.py, per config.mlp_types).
    moe = moe_fn or functools.partial(moe_block, dense=backends.xla_cpu)
    with jax.named_scope("moe" if "moe" in lp else "mlp"):
        h = h + (moe(lp["moe"], x, config, backends.moe) if "moe" in lp else dense_mlp(lp["mlp"], x, matmul))
    return h, (k_cache, v_cache, conv, rec), inputs


def rope_tables(batch: ForwardBatch, config: Qwen35MoeConfig) -> tuple[jax.Array, jax.Array]:
    """The step's rotary tables: 3-D M-RoPE for a step with image tokens, else plain RoPE at the position (plus
    the row's rope delta on a vision-language model: equal streams reduce M-RoPE to that)."""
    if batch.mrope_positions is not None:
        return mrope_cos_sin(batch.mrope_positions, config.rotary_dim, config.rope_theta, config.mrope_section)
    positions = batch.positions
    if batch.rope_deltas is not None:
        positions = positions + batch.rope_deltas[:, None]
    return rope_cos_sin(positions, config.rotary_dim, config.rope_theta)


def embed_tokens(embed: jax.Array, batch: ForwardBatch, config: Qwen35MoeConfig) -> jax.Array:
    """``[B, T, H]`` input embeddings; the image pad tokens take the step's image embeddings when it has any."""
    h = embed[batch.input_ids]
    if batch.image_embeds is None:
        return h
    is_image = (batch.input_ids == config.image_token_id)[..., None]
    return jnp.where(is_image, batch.image_embeds.astype(h.dtype), h)


def compute_logits(params: Params, hidden: jax.Array, *, config: Qwen35MoeConfig) -> jax.Array:
    """Vocabulary logits for selected rows.

    Args:
        params: parameter pytree; uses ``lm_head`` ``[V, H]`` (HF layout) or, when tied, ``embed``.
        hidden: ``[N, H]`` final-norm hidden states.
        config: static model config.

    Returns:
        ``[N, V]`` float32.
    """
    with jax.named_scope("lm_head"):
        return jnp.einsum("nh,vh->nv", hidden, lm_head_weight(params, config), preferred_element_type=jnp.float32)


def lm_head_weight(params: Params, config: Qwen35MoeConfig) -> jax.Array:
    """The ``[V, H]`` (HF layout) output projection: ``lm_head``, or ``embed`` when the embeddings are tied."""
    # [V, H] for both: contracting over the contiguous H axis is ~2.5x faster on XLA:CPU than [H, V].
    return params["embed"] if config.tie_word_embeddings else params["lm_head"]
