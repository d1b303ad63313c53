"""One table from every parameter and cache array to its ``PartitionSpec`` on a :class:`mesh.Layout`.

- experts (``w_gate``, ``w_up``, ``w_down``, and their FP8 scales): dim 0 split over ``expert``;
- every other parameter (embeddings, attention, Gated DeltaNet, router, shared expert, the dense SwiGLU MLP
  of dense layers, norms): replicated, so under DP attention each rank holds a dense model whole
  (docs/parallelism.md says what that costs against tensor parallelism);
- KV pages (the KV pool layout's ``page_axis`` of ``k``/``v``) and GDN slots (the state layout's ``slot_axis``
  of ``conv``/``rec``; kernels/ragged_paged_attention/layout.py, kernels/gdn/state_layout.py): split over the
  batch axes, so data-parallel rank ``r`` owns a contiguous block of pages and slots and addresses them by *local* ids
  (0 .. per-rank count - 1, local page 0 and slot 0 being that rank's trash targets);
- batch inputs (``tokens``, ``prefix_lens``, ``new_lens``, ``page_table``, ``slot_ids``) and the hidden
  output: dim 0 split over the batch axes (rank ``r`` owns rows ``[r*B/dp, (r+1)*B/dp)``).
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from sglang_tpu_qwen.kernels.gdn.state_layout import GDN_STATE_LAYOUT, GdnStateLayout
from sglang_tpu_qwen.kernels.ragged_paged_attention.layout import KVPoolLayout
from sglang_tpu_qwen.kernels.ragged_paged_attention.token_major import TOKEN_MAJOR
from sglang_tpu_qwen.parallel.mesh import EXPERT, Layout

EXPERT_LEAVES = frozenset({"w_gate", "w_up", "w_down"})


def _key_names(path: tuple[Any, ...]) -> set[str]:
    names = set()
    for k in path:
        for attr in ("key", "name"):
            v = getattr(k, attr, None)
            if isinstance(v, str):
                names.add(v)
    return names


def param_pspecs(params: Any, layout: Layout) -> Any:
    """PartitionSpec pytree matching ``params`` (arrays, ShapeDtypeStructs or FP8 leaves, fp8.py).

    Raises:
        ValueError: the expert count does not divide by the expert-parallel size.
    """

    def spec(path: tuple[Any, ...], leaf: Any) -> P:
        if _key_names(path) & EXPERT_LEAVES:
            # [G, E, in, out] (G: the layer-group dim of model/stacking.py) or [E, in, out].
            e_dim = len(leaf.shape) - 3
            if leaf.shape[e_dim] % layout.ep:
                raise ValueError(f"{leaf.shape[e_dim]} experts do not split {layout.ep} ways")
            return P(*([None] * e_dim), EXPERT)
        return P()

    return jax.tree_util.tree_map_with_path(spec, params)


def _split_axes(kv_layout: KVPoolLayout, state_layout: GdnStateLayout) -> dict[str, int]:
    """Cache key -> the axis DP splits: the KV layout's pages, the GDN state layout's slots."""
    return {"k": kv_layout.page_axis, "v": kv_layout.page_axis, "conv": state_layout.slot_axis,
            "rec": state_layout.slot_axis}


def cache_pspecs(layout: Layout, kv_layout: KVPoolLayout = TOKEN_MAJOR,
                 state_layout: GdnStateLayout = GDN_STATE_LAYOUT) -> dict[str, P]:
    """``{"k", "v", "conv", "rec"}`` -> spec: pages / slots split over the batch axes, at the axes the pools'
    layouts name (every KV layout keeps pages on ``layout.PAGE_AXIS``, so the default answers for all)."""
    return {name: P(*([None] * axis), layout.batch_axes)
            for name, axis in _split_axes(kv_layout, state_layout).items()}


def batch_pspec(layout: Layout) -> P:
    """Spec of a ``[B, ...]`` batch input or output: rows split over the batch axes."""
    return P(layout.batch_axes)


def shardings(pspecs: Any, layout: Layout) -> Any:
    """PartitionSpec pytree -> NamedSharding pytree on the layout's mesh."""
    return jax.tree.map(lambda s: NamedSharding(layout.mesh, s), pspecs, is_leaf=lambda x: isinstance(x, P))


def shard_params(params: Any, layout: Layout) -> Any:
    """Place a parameter pytree on the mesh (experts split, the rest replicated)."""
    return jax.device_put(params, shardings(param_pspecs(params, layout), layout))


def shard_cache(cache: dict[str, jax.Array], layout: Layout, kv_layout: KVPoolLayout = TOKEN_MAJOR,
                state_layout: GdnStateLayout = GDN_STATE_LAYOUT) -> dict[str, jax.Array]:
    """Place a cache from ``init_cache(config, dp * pages_per_rank, page_size, dp * slots_per_rank, ...)``
    (stored in ``kv_layout`` / ``state_layout``) on the mesh. Raises ValueError when pages or slot rows do not
    divide by ``layout.dp``."""
    for name, axis in _split_axes(kv_layout, state_layout).items():
        if cache[name].shape[axis] % layout.dp:
            raise ValueError(f"cache[{name!r}] has {cache[name].shape[axis]} pages/slots, not divisible by "
                             f"dp={layout.dp}")
    return jax.device_put(cache, shardings(cache_pspecs(layout, kv_layout, state_layout), layout))
