"""The chunk systems' inverse by recursive block inversion (kernels/gdn/unit_lower_inverse.py) against float64
``numpy.linalg.inv``: random systems and those of a repeated token (keys alike, write strength near
1, no decay), where the nilpotent product ``(I - L)(I + L^2)...`` the kernel used before was off by 1e7 or more.
float32 at ``HIGHEST``: max abs error 1e-5 (entries O(1)); one bfloat16 pass per product: 2e-2."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sglang_tpu_qwen.kernels.gdn.unit_lower_inverse import unit_lower_inverse, unit_lower_inverses


def _system(rng: np.random.Generator, c: int, similarity: float, beta: float) -> np.ndarray:
    """``tril(beta K K^T, -1)`` of C unit keys with pairwise cosine ~``similarity``."""
    base = rng.standard_normal(128)
    keys = similarity * base + math.sqrt(1 - similarity**2) * rng.standard_normal((c, 128))
    keys /= np.linalg.norm(keys, axis=1, keepdims=True)
    return np.tril(beta * keys @ keys.T, -1).astype(np.float32)


def _matmul(a: jax.Array, b: jax.Array, bf16: bool) -> jax.Array:
    if bf16:
        return jnp.matmul(a.astype(jnp.bfloat16), b.astype(jnp.bfloat16), preferred_element_type=jnp.float32)
    return jnp.matmul(a, b, precision=jax.lax.Precision.HIGHEST)


@pytest.mark.parametrize(("similarity", "beta"), [(0.0, 0.5), (0.9, 0.99), (1.0, 1.0)])
@pytest.mark.parametrize("bf16", [False, True], ids=["f32", "bf16"])
def test_inverse_of_chunk_systems(similarity: float, beta: float, bf16: bool) -> None:
    rng = np.random.default_rng(5)
    lower = np.stack([_system(rng, 64, similarity, beta) for _ in range(3)])  # batched, as parallel_chunks calls it
    inv = np.asarray(unit_lower_inverse(jnp.asarray(lower), functools.partial(_matmul, bf16=bf16)))
    exact = np.linalg.inv(np.eye(64) + lower.astype(np.float64))
    assert np.abs(exact).max() < 2  # the systems are well conditioned: only the powers of L are not
    assert np.abs(inv - exact).max() <= (2e-2 if bf16 else 1e-5)
    np.testing.assert_array_equal(np.triu(inv, 1), 0)


@pytest.mark.parametrize("c", [1, 2, 8])
def test_small_sizes(c: int) -> None:
    lower = _system(np.random.default_rng(6), c, 0.5, 0.9)
    inv = np.asarray(unit_lower_inverse(jnp.asarray(lower), functools.partial(_matmul, bf16=False)))
    np.testing.assert_allclose(inv, np.linalg.inv(np.eye(c) + lower), atol=1e-6)


@pytest.mark.parametrize("bf16", [False, True], ids=["f32", "bf16"])
def test_interleaved_systems_are_each_systems_inverse_bit_for_bit(bf16: bool) -> None:
    """The kernel emits several chunks' inverses level by level (MXU overlap); each must be exactly its own."""
    rng = np.random.default_rng(7)
    lowers = [jnp.asarray(_system(rng, 64, s, 0.9)) for s in (0.0, 0.5, 1.0)]
    matmul = functools.partial(_matmul, bf16=bf16)
    for together, alone in zip(unit_lower_inverses(lowers, matmul), lowers, strict=True):
        np.testing.assert_array_equal(np.asarray(together), np.asarray(unit_lower_inverse(alone, matmul)))


def test_rejects_sizes_not_powers_of_two() -> None:
    with pytest.raises(ValueError, match="power-of-two"):
        unit_lower_inverse(jnp.zeros((48, 48)), jnp.matmul)
    with pytest.raises(ValueError, match="one shape"):
        unit_lower_inverses([jnp.zeros((8, 8)), jnp.zeros((16, 16))], jnp.matmul)
    with pytest.raises(ValueError, match="one shape"):
        unit_lower_inverses([], jnp.matmul)
