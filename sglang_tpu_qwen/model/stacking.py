"""Stacked layer parameters: the layout ``forward_step`` scans over (contract: docs/internals.md).

The layers of Qwen3.5 repeat one period of kinds (3 Gated DeltaNet + 1 attention for the releases).
``params["layers"]`` is a list of ``period`` dicts; leaf ``layers[j][name]`` has a leading group dim
``G = num_hidden_layers // period`` and its index ``g`` is layer ``g * period + j``. One scan step of the
forward runs one group, so compile time does not grow with depth.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from sglang_tpu_qwen.model.config import Qwen35MoeConfig


def layer_period(config: Qwen35MoeConfig) -> int:
    """Smallest p dividing the depth with layer ``i`` of the same kind as layer ``i % p`` for every layer
    (kind: the mixer of ``layer_types`` and the MLP of ``mlp_types``)."""
    types = list(zip(config.layer_types, config.mlp_types, strict=True))
    n = len(types)
    for p in range(1, n + 1):
        if n % p == 0 and all(types[i] == types[i % p] for i in range(n)):
            return p
    raise AssertionError("unreachable: p == n always works")


def _stack(*xs: Any) -> Any:
    if isinstance(xs[0], jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct((len(xs), *xs[0].shape), xs[0].dtype)
    if isinstance(xs[0], np.ndarray):
        return np.stack(xs)
    return jnp.stack(xs)


def stack_layers(layers: list[Any], period: int) -> list[Any]:
    """Per-layer pytrees (numpy or jax arrays, or ShapeDtypeStructs) -> ``period`` pytrees with a leading
    group dim (numpy stays numpy). Raises ValueError when ``period`` does not divide ``len(layers)``."""
    if len(layers) % period:
        raise ValueError(f"{len(layers)} layers do not split into groups of {period}")
    return [jax.tree.map(_stack, *layers[j::period]) for j in range(period)]


def unstack_layers(stacked: list[Any]) -> list[Any]:
    """Inverse of :func:`stack_layers`: ``period`` stacked pytrees -> one pytree per layer, in layer order
    (leaves are index views ``leaf[g]``). ShapeDtypeStruct leaves lose their leading dim."""
    period = len(stacked)

    def take(g: int) -> Any:
        def f(x: Any) -> Any:
            if isinstance(x, jax.ShapeDtypeStruct):
                return jax.ShapeDtypeStruct(x.shape[1:], x.dtype)
            return x[g]

        return f

    groups = jax.tree.leaves(stacked[0])[0].shape[0]
    return [jax.tree.map(take(g), stacked[j]) for g in range(groups) for j in range(period)]


def stack_params(params: dict[str, Any], config: Qwen35MoeConfig) -> dict[str, Any]:
    """A pytree with a per-layer ``layers`` list -> the same with :func:`stack_layers` of it."""
    return {**params, "layers": stack_layers(params["layers"], layer_period(config))}


def unstack_params(params: dict[str, Any]) -> dict[str, Any]:
    """A stacked pytree -> the same with one ``layers`` entry per layer (:func:`unstack_layers`)."""
    return {**params, "layers": unstack_layers(params["layers"])}
