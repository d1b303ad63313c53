"""The jnp reference of kernels/greedy_head: the float32 logits, then ``jnp.argmax``."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def greedy_lm_head_reference(hidden: jax.Array, weight: jax.Array) -> jax.Array:
    """Greedy ids ``[N]`` int32 of ``hidden [N, H] @ weight [V, H]^T`` with float32 accumulation: per row the lowest
    id of the largest logit (or of the first NaN). One variadic reduce, which XLA fuses into the product's output
    (the ``[N, V]`` logits are not written to HBM on a TPU; engine/runner/sampler.greedy_ids)."""
    logits = jnp.einsum("nh,vh->nv", hidden, weight, preferred_element_type=jnp.float32)
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
