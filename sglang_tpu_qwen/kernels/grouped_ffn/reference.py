"""The jnp reference of kernels/grouped_ffn: the routed experts' SwiGLU FFN as the model computes it for dense
stacks (model/moe.py through ``MoeBackend.grouped_swiglu`` and ``grouped``), three ``jax.lax.ragged_dot``
products, each rounded to the input dtype."""

from __future__ import annotations

import jax


def grouped_ffn_reference(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array,
                          group_sizes: jax.Array) -> jax.Array:
    """``down(silu(x gate) * (x up))`` per row with its group's weights.

    Args:
        x: ``[M, H]`` rows sorted by group; w_gate, w_up: ``[E, H, I]``; w_down: ``[E, I, H]``;
            group_sizes: ``[E]`` int32 (sum <= M).

    Returns:
        ``[M, H]`` in x's dtype; rows past the groups 0.
    """

    def product(a: jax.Array, w: jax.Array) -> jax.Array:
        return jax.lax.ragged_dot(a, w, group_sizes, preferred_element_type=a.dtype).astype(a.dtype)

    return product(jax.nn.silu(product(x, w_gate)) * product(x, w_up), w_down)
