"""Reduce-scatter for the MoE combine: flat (one ``psum_scatter``) or hierarchical (two).

Hierarchical: stage 1 reduce-scatters between the two TensorCores of a chip (bit 0 of the expert-axis
index, see mesh.py), stage 2 across the chips among the devices with the same core index, so the bytes
that cross chips are the halves the intra-chip stage has already summed (the two-level scheme of
Thakur, Rabenseifner and Gropp, "Optimization of collective communication operations in MPICH", IJHPCA
2005). Both stages are XLA reduce-scatters over replica groups: on Ironwood XLA runs them on the
SparseCores, beside the TensorCores' work, and their adds never pass through a TensorCore fusion.
(Recursive halving written out as ``ppermute`` + add per step moved ~3x the bytes of the sums through
HBM per layer: each half it sent was sliced into its own buffer, and each sum was a TensorCore pass.)

A tiled ``psum_scatter`` over a group hands contiguous slices of its operand to the group's members in
order, so the hierarchical combine needs the blocks of ``y`` in core-major order (:func:`block_order`):
the caller writes its sums there directly (the expert-parallel MoE picks each token's destination row).
"""

from __future__ import annotations

import jax
import numpy as np

COMBINES = ("flat", "hierarchical")
CORES_PER_CHIP = 2


def _two_stage(combine: str, n: int) -> bool:
    """Whether ``combine`` on an axis of ``n`` devices runs the two stages (else it is one reduce-scatter)."""
    if combine not in COMBINES:
        raise ValueError(f"unknown combine {combine!r}; expected one of {COMBINES}")
    return combine == "hierarchical" and n > CORES_PER_CHIP and n % CORES_PER_CHIP == 0


def block_order(combine: str, n: int) -> np.ndarray:
    """Where each device's block sits in the reduce-scatter's operand.

    Args:
        combine: ``"flat"`` or ``"hierarchical"``.
        n: expert-axis size.

    Returns:
        ``[n]`` int32: entry ``d`` is the block index (rows ``[i*R, (i+1)*R)``) holding device ``d``'s rows.
        Flat: ``d``. Hierarchical: ``(d % 2) * (n / 2) + d // 2`` (core-major), so stage 1's halves are one
        per core of a chip and stage 2's slices one per chip.

    Raises:
        ValueError: unknown ``combine``.
    """
    d = np.arange(n, dtype=np.int32)
    if not _two_stage(combine, n):
        return d
    return (d % CORES_PER_CHIP) * (n // CORES_PER_CHIP) + d // CORES_PER_CHIP


def reduce_scatter(
    y: jax.Array, axis_name: str | tuple[str, ...], axis_size: int, combine: str = "hierarchical"
) -> jax.Array:
    """Sum ``y`` over the expert axis and keep this device's block.

    Args:
        y: ``[n * R, ...]`` (n = ``axis_size``), device ``d``'s rows in block ``block_order(combine, n)[d]``.
        axis_name: mesh axis (or axes) inside ``shard_map``; index bit 0 = core within a chip (mesh.py).
        axis_size: ``n`` (static).
        combine: ``"flat"`` (one reduce-scatter over the axis) or ``"hierarchical"`` (intra-chip pairs, then
            across chips; one reduce-scatter when ``n`` is odd or at most 2).

    Returns:
        ``[R, ...]``: the sum over devices of this device's block.

    Raises:
        ValueError: unknown ``combine``, or ``n`` does not divide ``y.shape[0]``.
    """
    n = axis_size
    if y.shape[0] % n:
        raise ValueError(f"reduce-scatter over {n} devices of {y.shape[0]} rows")
    if not _two_stage(combine, n):
        return jax.lax.psum_scatter(y, axis_name, scatter_dimension=0, tiled=True)
    c = CORES_PER_CHIP
    chips = n // c
    # Stage 1, within each chip: member b (core b) keeps half b, the blocks of every chip's core b.
    pairs = [[chip * c + b for b in range(c)] for chip in range(chips)]
    y = jax.lax.psum_scatter(y, axis_name, scatter_dimension=0, tiled=True, axis_index_groups=pairs)
    # Stage 2, across chips among the devices of one core index: member j (chip j) keeps slice j.
    same_core = [[chip * c + b for chip in range(chips)] for b in range(c)]
    return jax.lax.psum_scatter(y, axis_name, scatter_dimension=0, tiled=True, axis_index_groups=same_core)
