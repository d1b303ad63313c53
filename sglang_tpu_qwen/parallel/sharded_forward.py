"""``forward_step`` over a device mesh: DP attention + expert-parallel MoE in one ``shard_map``.

Each data-parallel rank runs the model's own ``forward_step`` on its rows of the batch with its own block
of KV pages and GDN slots (local ids), and the MoE of every layer goes through the expert-parallel path
(expert_parallel.py) over the ``expert`` axis. Same contract as ``model.forward.forward_step``
(docs/internals.md) except that page and slot ids are rank-local (sharding.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import PartitionSpec as P

from sglang_tpu_qwen.model.config import Qwen35MoeConfig
from sglang_tpu_qwen.model.forward import forward_step
from sglang_tpu_qwen.model.forward_batch import ForwardBatch
from sglang_tpu_qwen.parallel.expert_parallel import make_ep_moe_fn
from sglang_tpu_qwen.parallel.mesh import EXPERT, Layout
from sglang_tpu_qwen.parallel.sharding import batch_pspec, cache_pspecs, param_pspecs

ForwardFn = Callable[..., tuple[jax.Array, dict[str, jax.Array]]]


def make_sharded_forward(
    layout: Layout,
    config: Qwen35MoeConfig,
    params_like: Any,
    *,
    combine: str = "hierarchical",
    micro_batches: int = 1,
    forward: ForwardFn = forward_step,
    verify_gdn_layers: int | None = None,
) -> ForwardFn:
    """Build ``fwd(params, cache, batch: ForwardBatch) -> (hidden, cache)``.

    Args:
        layout: from ``mesh.make_layout``.
        config: model config.
        params_like: the parameter pytree (or its ShapeDtypeStructs) the function will be called with;
            only its structure is used, to build the sharding specs.
        combine: MoE reduce-scatter, ``"flat"`` or ``"hierarchical"`` (``--moe-combine``).
        micro_batches: MoE micro-batches per layer.
        forward: per-rank step with ``forward_step``'s signature plus ``moe_fn`` (the planner passes a
            scanned variant).
        verify_gdn_layers: for ``TARGET_VERIFY`` batches (speculative decoding): the GDN layers per layer
            period, whose saved inputs (``forward_step``'s third output, ``[G, B, ...]``) are split by rows too.

    Returns:
        An un-jitted function; jit it with ``donate_argnums=(1,)``. Inputs: params placed with
        ``sharding.shard_params``, cache with ``sharding.shard_cache``; the batch's arrays ``[B, ...]`` with
        ``B % layout.dp == 0``, rank ``r`` owning rows ``[r*B/dp, (r+1)*B/dp)``, page/slot ids local to
        the rank (its ``token_src`` None: the runner resolves it before the model). Output hidden
        ``[B, T, H]`` is split the same way.
    """
    moe_fn = make_ep_moe_fn(
        EXPERT,
        layout.ep,
        tokens_replicated=not layout.attention_spans_experts,
        combine=combine,
        micro_batches=micro_batches,
    )
    body = functools.partial(forward, config=config, moe_fn=moe_fn)
    b = batch_pspec(layout)
    cspec = cache_pspecs(layout)
    out_specs: tuple[Any, ...] = (b, cspec)
    if verify_gdn_layers is not None:
        rows = grouped_rows_pspec(layout)
        out_specs = (b, cspec, tuple((rows, rows, rows) for _ in range(verify_gdn_layers)))

    def fwd(params: Any, cache: Any, batch: ForwardBatch) -> tuple[jax.Array, dict[str, jax.Array]]:
        # Every array of the batch is split by rows over the DP ranks (the spec tree follows the batch's).
        bspec = jax.tree.map(lambda _: b, batch)
        return jax.shard_map(
            body,
            mesh=layout.mesh,
            in_specs=(param_pspecs(params_like, layout), cspec, bspec),
            out_specs=out_specs,
            check_vma=False,
        )(params, cache, batch)

    return fwd


def grouped_rows_pspec(layout: Layout) -> P:
    """Spec of a ``[G, B, ...]`` array (a verify step's saved GDN inputs): rows (dim 1) split over the DP ranks."""
    return P(None, layout.batch_axes)


def make_sharded_rows(layout: Layout, config: Qwen35MoeConfig, params_like: Any, fn: Callable[..., Any],
                      in_specs: tuple[Any, ...], out_specs: Any, *,
                      combine: str = "hierarchical") -> Callable[..., Any]:
    """``fn(params, cache, batch, *rest, config=, moe_fn=)`` run by every DP rank on its rows, the MoE over the
    expert axis as in :func:`make_sharded_forward` (speculative decoding's draft and commit programs).

    ``in_specs``: the specs of ``rest``; ``out_specs``: of the result. Params, cache and batch get theirs as in
    :func:`make_sharded_forward`."""
    moe_fn = make_ep_moe_fn(EXPERT, layout.ep, tokens_replicated=not layout.attention_spans_experts, combine=combine)
    body = functools.partial(fn, config=config, moe_fn=moe_fn)
    b = batch_pspec(layout)

    def run(params: Any, cache: Any, batch: ForwardBatch, *rest: Any) -> Any:
        bspec = jax.tree.map(lambda _: b, batch)
        return jax.shard_map(body, mesh=layout.mesh,
                             in_specs=(param_pspecs(params_like, layout), cache_pspecs(layout), bspec, *in_specs),
                             out_specs=out_specs, check_vma=False)(params, cache, batch, *rest)

    return run
