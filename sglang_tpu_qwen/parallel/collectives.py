"""Reduce-scatter for the MoE combine: flat (one ``psum_scatter``) or hierarchical (recursive halving).

Hierarchical: stage 1 exchanges halves between the two TensorCores of a chip (bit 0 of the axis index,
see mesh.py), stage 2 halves again across chips, one bit of the chip index per step (recursive halving,
Thakur, Rabenseifner and Gropp, "Optimization of collective communication operations in MPICH", IJHPCA
2005). Each step sends half of what is left to one partner with ``ppermute`` and adds what comes back,
so the bytes crossing chips are half of what a flat ring moves over the same links before the
intra-chip stage has summed the pair.
"""

from __future__ import annotations

import jax

COMBINES = ("flat", "hierarchical")


def _is_pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def flat_reduce_scatter(y: jax.Array, axis_name: str | tuple[str, ...]) -> jax.Array:
    """Sum ``y`` over the axis and keep this device's block.

    Args:
        y: ``[n * R, ...]`` (n = axis size); block ``i`` (rows ``[i*R, (i+1)*R)``) belongs to device ``i``.
        axis_name: mesh axis (or axes) inside ``shard_map``.

    Returns:
        ``[R, ...]``: the sum over devices of block ``axis_index``.
    """
    return jax.lax.psum_scatter(y, axis_name, scatter_dimension=0, tiled=True)


def hierarchical_reduce_scatter(y: jax.Array, axis_name: str | tuple[str, ...], axis_size: int) -> jax.Array:
    """Same result as :func:`flat_reduce_scatter`, by recursive halving: intra-chip pair first, then chips.

    Args:
        y: ``[n * R, ...]`` with ``n == axis_size`` a power of two.
        axis_name: mesh axis (or axes) inside ``shard_map``; index bit 0 = core within a chip.
        axis_size: ``n`` (static).

    Returns:
        ``[R, ...]``.

    Raises:
        ValueError: ``axis_size`` is not a power of two or does not divide ``y.shape[0]``.
    """
    n = axis_size
    if not _is_pow2(n) or y.shape[0] % n:
        raise ValueError(f"hierarchical reduce-scatter needs a power-of-two axis dividing {y.shape[0]}, got {n}")
    me = jax.lax.axis_index(axis_name)
    rows = y.shape[0] // n
    # Blocks still held, indexed by the destination bits not yet settled (the low bits are settled first).
    held = y.reshape(n, rows, *y.shape[1:])
    bit = 0
    while held.shape[0] > 1:
        # Block index j = 2 * hi + b where b is the destination's bit `bit`: split on b.
        pairs = held.reshape(held.shape[0] // 2, 2, rows, *y.shape[1:])
        mine = (me >> bit) & 1
        # Dynamic slices, not selects: a select reads both halves and writes a copy of the one it keeps.
        keep = jax.lax.dynamic_index_in_dim(pairs, mine, axis=1, keepdims=False)
        send = jax.lax.dynamic_index_in_dim(pairs, 1 - mine, axis=1, keepdims=False)
        perm = [(i, i ^ (1 << bit)) for i in range(n)]
        held = keep + jax.lax.ppermute(send, axis_name, perm)
        bit += 1
    return held[0]


def reduce_scatter(
    y: jax.Array, axis_name: str | tuple[str, ...], axis_size: int, combine: str = "hierarchical"
) -> jax.Array:
    """Dispatch on ``combine`` (``"flat"`` or ``"hierarchical"``); hierarchical falls back to flat when the
    axis size is not a power of two. Raises ValueError for an unknown ``combine``."""
    if combine not in COMBINES:
        raise ValueError(f"unknown combine {combine!r}; expected one of {COMBINES}")
    if combine == "flat" or axis_size == 1 or not _is_pow2(axis_size):
        return flat_reduce_scatter(y, axis_name)
    return hierarchical_reduce_scatter(y, axis_name, axis_size)
