"""The inverse of a chunk's unit lower triangular system ``I + L`` by recursive block inversion, in matmuls.

The chunked delta rule solves ``(I + L) [U | W] = [diag(beta) V | diag(beta) K exp(cum)]`` per chunk of C tokens
(``L = tril(diag(beta) K K^T * D, -1)``, ``kernels/gdn/kernel.py``). On a TPU a row-by-row substitution is a
chain of C vector steps, so the inverse is built from C x C products on the MXU instead.

Why not the nilpotent product ``(I - L)(I + L^2)(I + L^4)...`` (exact in exact arithmetic, and what the kernel
first used): its factors hold the powers ``L^(2^k)``, whose entries grow like binomial coefficients when L's
entries approach 1 (keys of a chunk alike, ``beta`` near 1, little decay: a repeated token does it), up to
~1e17 at C = 64, and float32 loses the cancellation even though the inverse's entries are O(1). A prompt of
one repeated token gave outputs of 1e20 where the reference gave 0.16 (tests/test_kernels_gdn.py).

Recursive block inversion keeps every intermediate an actual block of the inverse: for a unit lower
triangular ``[[A, 0], [B, D]]`` the inverse is ``[[A^-1, 0], [-D^-1 B A^-1, D^-1]]`` (Higham, "Accuracy and
Stability of Numerical Algorithms", 2nd ed., section 14.2.2, the block method). Bottom up over the whole
matrix at once: ``X`` holds the inverses of the diagonal blocks of size s (block diagonal); with ``M_s`` the
entries of L between the two halves of each diagonal block of size 2s, ``X <- X - X (L * M_s) X`` gives the
inverses of the blocks of size 2s. Blocks of 2 are inverted directly (``I - L`` on them); then
log2(C) - 1 levels of two products each (ten at C = 64, as many as the nilpotent product took).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp


def unit_lower_inverse(lower: jax.Array, matmul: Callable[[jax.Array, jax.Array], jax.Array]) -> jax.Array:
    """``(I + lower)^-1`` by recursive block inversion (module docstring).

    Args:
        lower: ``[..., C, C]`` float32, strictly lower triangular (the upper triangle and diagonal must be 0);
            C a power of two.
        matmul: ``(a [..., C, C], b [..., C, C]) -> a @ b`` float32; the caller's precision (its MXU passes).
            Works inside a Pallas TPU kernel (2-D tiles) and in XLA (batched).

    Returns:
        ``[..., C, C]`` float32, unit lower triangular.

    Raises:
        ValueError: C is not a power of two.
    """
    return unit_lower_inverses([lower], matmul)[0]


def unit_lower_inverses(lowers: Sequence[jax.Array],
                        matmul: Callable[[jax.Array, jax.Array], jax.Array]) -> list[jax.Array]:
    """:func:`unit_lower_inverse` of several independent systems, emitted level by level across them.

    In a Pallas TPU kernel the MXU runs its products in program order, so one system's chain of dependent
    products leaves it waiting on each result; emitting every system's product of a level before the next level
    lets the independent products fill those waits (bench/mxu_chain.py measured 8 interleaved chains of
    64 x 64 products in the time of one). Each system's arithmetic is unchanged, so the results are bit for bit
    those of one call per system.

    Args:
        lowers: ``[..., C, C]`` float32 strictly lower triangular matrices of one shape; C a power of two.
        matmul: as for :func:`unit_lower_inverse`.

    Returns:
        The inverses, in the order of ``lowers``.

    Raises:
        ValueError: no systems, systems of different shapes, or C not a power of two.
    """
    if not lowers or any(lower.shape != lowers[0].shape for lower in lowers):
        raise ValueError(f"unit_lower_inverses needs systems of one shape, got {[x.shape for x in lowers]}")
    c = lowers[0].shape[-1]
    if c & (c - 1):
        raise ValueError(f"unit_lower_inverse needs a power-of-two size, got {c}")
    row = jax.lax.broadcasted_iota(jnp.int32, (c, c), 0)
    col = jax.lax.broadcasted_iota(jnp.int32, (c, c), 1)
    # Entries (i, j) with i ^ j in [s, 2s) lie in the same diagonal block of size 2s and different ones of size
    # s: the off-diagonal block that level s fills in (bit arithmetic, which Mosaic lowers on int32 vectors).
    level = row ^ col
    eye = (row == col).astype(jnp.float32)
    invs = [eye - jnp.where(level == 1, lower, 0.0) for lower in lowers]
    s = 2
    while s < c:
        inside = (level >= s) & (level < 2 * s)
        halves = [matmul(jnp.where(inside, lower, 0.0), inv) for lower, inv in zip(lowers, invs, strict=True)]
        invs = [inv - matmul(inv, half) for inv, half in zip(invs, halves, strict=True)]
        s *= 2
    return invs
