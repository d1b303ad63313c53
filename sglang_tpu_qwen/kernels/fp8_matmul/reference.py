"""jnp reference of the block-FP8 grouped matmul: dequantise, then ``ragged_dot`` (the test oracle)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def dequantize_blocks(q: jax.Array, scale: jax.Array, block: tuple[int, int], dtype: jax.typing.DTypeLike) -> jax.Array:
    """``[..., R, C]`` in ``dtype``: ``q * scale[..., r // b0, c // b1]`` (edge blocks may be partial)."""
    r, c = q.shape[-2:]
    rows = jnp.arange(r) // block[0]
    cols = jnp.arange(c) // block[1]
    s = jnp.take(jnp.take(scale, rows, axis=-2), cols, axis=-1)
    return (q.astype(jnp.float32) * s).astype(dtype)


def fp8_grouped_matmul_reference(
    x: jax.Array, q: jax.Array, scale: jax.Array, group_sizes: jax.Array, block: tuple[int, int],
    layer: jax.Array | int | None = None,
) -> jax.Array:
    """Same contract as ``kernel.fp8_grouped_matmul``, computed in float32 on the dequantised weights."""
    if q.ndim == 4:
        q = q[layer]
    w = dequantize_blocks(q, scale, block, jnp.float32)
    out = jax.lax.ragged_dot(x.astype(jnp.float32), w, group_sizes, precision=jax.lax.Precision.HIGHEST)
    total = jnp.sum(group_sizes)
    return jnp.where(jnp.arange(x.shape[0])[:, None] < total, out, 0.0)


def fp8_grouped_swiglu_reference(
    x: jax.Array, q_gate: jax.Array, scale_gate: jax.Array, q_up: jax.Array, scale_up: jax.Array,
    group_sizes: jax.Array, block: tuple[int, int], row_scale: jax.Array | None = None,
) -> jax.Array:
    """Same contract as ``kernel.fp8_grouped_swiglu`` (3-D weights), in float32: ``silu(gate) * up`` of the
    two references, times ``row_scale`` per row."""
    gate = fp8_grouped_matmul_reference(x, q_gate, scale_gate, group_sizes, block)
    up = fp8_grouped_matmul_reference(x, q_up, scale_up, group_sizes, block)
    out = jax.nn.silu(gate) * up
    return out if row_scale is None else out * row_scale[:, None]


def fp8_grouped_matmul_scatter_add_reference(
    x: jax.Array, q: jax.Array, scale: jax.Array, group_sizes: jax.Array, dest: jax.Array, acc: jax.Array,
    block: tuple[int, int], overwrite: jax.Array | None = None,
) -> jax.Array:
    """Same contract as ``kernel.fp8_grouped_matmul_scatter_add`` (3-D weights): the float32 reference
    product of each covered row, rounded to ``acc.dtype``, added into ``acc[dest[r]]`` (or replacing it where
    ``overwrite[r]``) one row at a time in row order (the kernel's order: rows are sorted by group)."""
    product = fp8_grouped_matmul_reference(x, q, scale, group_sizes, block).astype(acc.dtype)
    flat = acc.reshape(acc.shape[0], -1)
    keep = jnp.ones(dest.shape, bool) if overwrite is None else jnp.logical_not(overwrite)

    def add(r: jax.Array, a: jax.Array) -> jax.Array:
        prev = jnp.where(keep[r], a[dest[r]].astype(jnp.float32), 0.0)
        return a.at[dest[r]].set((prev + product[r].astype(jnp.float32)).astype(a.dtype))

    return jax.lax.fori_loop(0, jnp.sum(group_sizes), add, flat).reshape(acc.shape)
