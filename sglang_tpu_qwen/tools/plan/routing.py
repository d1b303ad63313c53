"""Expert traffic of the slowest device of an expert-parallel MoE layer, under a stated routing distribution.

Each MoE layer ends in a reduce-scatter of the experts' sums, so a layer lasts as long as its slowest device.
A step routes ``tokens`` tokens (all DP ranks' tokens: the EP group sees every token), each to ``top_k``
distinct experts of ``num_experts``; device ``j`` holds experts ``[j*g, (j+1)*g)`` (``g = num_experts / ep``).
Per device it reads the weights of each local expert that some token picked (distinct experts: the bytes of a
memory-bound step) and computes each local (token, expert) pair (the flops of a compute-bound one).

Distributions:
- ``uniform``: every expert equally likely (what a router trained with load balancing aims at).
- ``zipf``: expert of popularity rank r picked with weight r^-s (s stated), a token's k experts drawn without
  replacement in proportion to the weights (successive sampling); ranks placed on expert ids by a fixed-seed
  permutation (popularity does not follow expert ids).

Analytic: a token includes expert e with probability pi_e (uniform: k / E exactly; zipf: Rosen's approximation
for successive sampling, pi_e = 1 - exp(-lam * q_e) with lam solving sum(pi) = k). A step touches e with
P_e = 1 - (1 - pi_e)^T. A device's distinct-expert count is taken as a sum of independent Bernoulli(P_e)
(exact distribution by convolution), its pair count as normal with mean T * sum(pi) and variance
T * sum(pi * (1 - pi)); the slowest device's expectation is E[max_j X_j] = sum_x (1 - prod_j F_j(x)) over
independent devices. ``monte_carlo`` checks all of it by sampling (fixed seed).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

ZIPF_S = 0.5  # the skewed distribution's parameter: the hottest of 512 experts gets 11.7x the mean load
PLACEMENT_SEED = 0


@dataclasses.dataclass(frozen=True)
class Routing:
    """A routing distribution: ``name`` ("uniform" or "zipf") and the Zipf exponent ``s`` (0 for uniform)."""

    name: str
    s: float = 0.0

    @property
    def label(self) -> str:
        return "uniform" if self.name == "uniform" else f"zipf(s={self.s:g})"


UNIFORM = Routing("uniform")
ZIPF = Routing("zipf", ZIPF_S)
DISTRIBUTIONS = (UNIFORM, ZIPF)


def popularity(num_experts: int, routing: Routing) -> np.ndarray:
    """``[E]`` float64 weights summing to 1, indexed by expert id (Zipf ranks placed by a fixed-seed
    permutation)."""
    if routing.name == "uniform":
        return np.full(num_experts, 1.0 / num_experts)
    w = np.arange(1, num_experts + 1, dtype=np.float64) ** -routing.s
    perm = np.random.default_rng(PLACEMENT_SEED).permutation(num_experts)
    return (w / w.sum())[perm]


def inclusion(q: np.ndarray, top_k: int) -> np.ndarray:
    """Per-token inclusion probability of each expert when ``top_k`` distinct experts are drawn in proportion
    to ``q``: exact for equal weights (k / E), else Rosen's successive-sampling approximation."""
    if np.allclose(q, q[0]):
        return np.full_like(q, top_k / len(q))
    lo, hi = 0.0, 1.0
    while np.sum(1.0 - np.exp(-hi * q)) < top_k:
        hi *= 2.0
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if np.sum(1.0 - np.exp(-mid * q)) < top_k else (lo, mid)
    return 1.0 - np.exp(-hi * q)


def _expected_max_discrete(pmfs: list[np.ndarray]) -> float:
    n = max(len(p) for p in pmfs)
    cdf = np.ones(n)
    for p in pmfs:
        c = np.cumsum(np.pad(p, (0, n - len(p))))
        cdf *= np.minimum(c, 1.0)
    return float(np.sum(1.0 - cdf[:-1]))  # E[max] = sum_{x >= 0} P(max > x)


def _poisson_binomial(ps: np.ndarray) -> np.ndarray:
    pmf = np.array([1.0])
    for p in ps:
        pmf = np.convolve(pmf, [1.0 - p, p])
    return pmf


def _expected_max_normal(means: np.ndarray, sds: np.ndarray) -> float:
    hi = float(np.max(means + 8 * sds)) + 1.0
    xs = np.linspace(0.0, hi, 20001)
    cdf = np.ones_like(xs)
    for m, s in zip(means, sds, strict=True):
        z = (xs - m) / max(s, 1e-12) / math.sqrt(2)
        cdf *= 0.5 * (1.0 + _erf(z))
    return float(np.trapezoid(1.0 - cdf, xs))


def _erf(z: np.ndarray) -> np.ndarray:
    # Abramowitz-Stegun 7.1.26 (|error| < 1.5e-7): numpy has no erf and scipy is not a dependency.
    sign = np.sign(z)
    a = np.abs(z)
    t = 1.0 / (1.0 + 0.3275911 * a)
    y = 1.0 - (((((1.061405429 * t - 1.453152027) * t) + 1.421413741) * t - 0.284496736) * t + 0.254829592) * t \
        * np.exp(-a * a)
    return sign * y


def expert_load(num_experts: int, top_k: int, ep: int, tokens: int, routing: Routing) -> dict[str, float]:
    """Per-device expert traffic of one MoE layer for a step of ``tokens`` tokens, analytic.

    Returns ``{"mean_experts", "max_experts", "mean_pairs", "max_pairs"}``: distinct local experts touched
    and local (token, expert) pairs, averaged over devices and expected on the slowest of the ``ep``.

    Raises:
        ValueError: ``num_experts`` not a multiple of ``ep``, or ``top_k`` > ``num_experts``.
    """
    if num_experts % ep or top_k > num_experts:
        raise ValueError(f"{num_experts} experts over ep={ep} with top-{top_k}")
    g = num_experts // ep
    pi = inclusion(popularity(num_experts, routing), top_k)
    touched = 1.0 - (1.0 - pi) ** tokens
    per_dev = touched.reshape(ep, g)
    pi_dev = pi.reshape(ep, g)
    pair_mean = tokens * pi_dev.sum(axis=1)
    pair_sd = np.sqrt(tokens * (pi_dev * (1.0 - pi_dev)).sum(axis=1))
    return {
        "mean_experts": float(per_dev.sum(axis=1).mean()),
        "max_experts": _expected_max_discrete([_poisson_binomial(p) for p in per_dev]),
        "mean_pairs": float(pair_mean.mean()),
        "max_pairs": _expected_max_normal(pair_mean, pair_sd),
    }


def monte_carlo(num_experts: int, top_k: int, ep: int, tokens: int, routing: Routing, *, trials: int,
                seed: int = 0) -> dict[str, float]:
    """The same four figures as :func:`expert_load`, by sampling ``trials`` layer steps (numpy, fixed
    ``seed``): each token's experts are the top-k of log(q) + Gumbel noise (exactly successive sampling in
    proportion to q)."""
    g = num_experts // ep
    logq = np.log(popularity(num_experts, routing))
    rng = np.random.default_rng(seed)
    sums = np.zeros(4)
    for _ in range(trials):
        keys = logq[None, :] + rng.gumbel(size=(tokens, num_experts))
        picked = np.argpartition(-keys, top_k - 1, axis=1)[:, :top_k]
        counts = np.bincount(picked.reshape(-1), minlength=num_experts).reshape(ep, g)
        experts = (counts > 0).sum(axis=1)
        pairs = counts.sum(axis=1)
        sums += (experts.mean(), experts.max(), pairs.mean(), pairs.max())
    mean = sums / trials
    return dict(zip(("mean_experts", "max_experts", "mean_pairs", "max_pairs"), map(float, mean), strict=True))


def kernel_expected_experts(num_experts: int, top_k: int, ep: int, tokens: int) -> float:
    """Local experts the FP8 MoE kernel's declared traffic assumes (kernels/fp8_matmul/kernel.py ``_cost``:
    ``g * (1 - (1 - 1/g) ** rows)`` for the device's expected ``rows = tokens * k * g / E`` pairs): the mean
    device under uniform routing, which the compiled HLO bytes already hold. The planner counts a
    ``jax.lax.ragged_dot`` (which skips experts without rows) at the same experts (build.py)."""
    g = num_experts // ep
    rows = int(tokens * top_k * g / num_experts)
    return g * (1.0 - (1.0 - 1.0 / g) ** rows)
