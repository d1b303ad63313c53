"""The chunked gated delta rule as XLA programs: every chunk's products at once, only the state scanned.

An alternative to the fused kernel's chunked form for the TPU's prefill (issue 44; ``bench.kernels``,
implementation ``xla``; ``--gdn-backend xla-chunked`` serves it, the kernel keeping decode). Measured on v5e
(2026-12-07, docs/performance.md), whole 35B-shaped prefills ran 11-14% slower with it than with the kernel.
The fused kernel walks one (row, key head) at a time and runs each 64-token chunk as a chain of dependent 64 x 64
MXU products (the chip profile puts it at 1.8% of the bf16 peak); here each product is one batched ``dot_general``
over every (row, head, chunk), as FLA's Triton kernels split the work (Yang et al., "Parallelizing Linear
Transformers with the Delta Rule over Sequence Length", NeurIPS 2024; fla-org/flash-linear-attention
``chunk_gated_delta_rule``):

1. in-chunk cumulative log-decay ``cum``, pairwise decays ``D[i, j] = exp(cum_i - cum_j)`` (i >= j);
2. ``L = tril(diag(beta) K K^T * D, -1)`` and ``(I + L)^-1`` by recursive block inversion (ten products at
   C = 64, as the fused kernel computes it: ``kernels/gdn/unit_lower_inverse.py``);
3. ``U = (I + L)^-1 diag(beta) V`` and ``W = (I + L)^-1 diag(beta) K exp(cum)``;
4. the only sequential part, per (row, head) over chunks: ``V' = U - W S``, ``S <- exp(cum_C) S +
   (K exp(cum_C - cum))^T V'``, which keeps each chunk's starting state;
5. ``O = (Q exp(cum)) S_start + tril(Q K^T * D) V'`` for every chunk at once.

Precision follows the fused kernel's rule: ``bf16=True`` (a bfloat16 model) runs each product in one MXU pass
over bfloat16 operands with float32 accumulation, as FLA does for bf16 models; ``bf16=False`` at ``HIGHEST``.
The log-decay sums, the decays and the state stay float32.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from sglang_tpu_qwen.kernels.gdn.delta_rule import CHUNK_SIZE, chunk_decays, from_chunks, to_chunks
from sglang_tpu_qwen.kernels.gdn.kernel import RECURRENT_MAX_T, fused_gdn
from sglang_tpu_qwen.kernels.gdn.reference import fused_gdn_reference
from sglang_tpu_qwen.kernels.gdn.unit_lower_inverse import unit_lower_inverse


def _einsum(spec: str, a: jax.Array, b: jax.Array, bf16: bool) -> jax.Array:
    """float32 ``einsum`` of two float32 operands: one bfloat16 MXU pass with ``bf16``, else ``HIGHEST``."""
    if bf16:
        return jnp.einsum(spec, a.astype(jnp.bfloat16), b.astype(jnp.bfloat16), preferred_element_type=jnp.float32)
    return jnp.einsum(spec, a, b, precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)


def parallel_chunk_gated_delta_rule(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    state: jax.Array,
    *,
    bf16: bool = False,
    chunk_size: int = CHUNK_SIZE,
) -> tuple[jax.Array, jax.Array]:
    """The gated delta rule over T tokens: same inputs and result as ``delta_rule.recurrent_gated_delta_rule``.

    Args:
        q, k: ``[B, T, H, dk]`` float32 (q scaled and both L2-normalised, k zero at padded tokens).
        v: ``[B, T, H, dv]`` float32.
        g, beta: ``[B, T, H]`` float32 log-decay and write strength (0 at padded tokens).
        state: ``[B, H, dk, dv]`` float32, the state before the first token.
        bf16: one bfloat16 MXU pass per product (a bfloat16 model), else ``HIGHEST``.
        chunk_size: tokens per chunk C; T is padded to a multiple with tokens that change nothing.

    Returns:
        ``(o [B, T, H, dv] float32, state [B, H, dk, dv] float32)``.
    """
    t, c = k.shape[1], chunk_size
    q, k, v, g, beta = to_chunks((q, k, v, g, beta), c)
    cum, decay, causal = chunk_decays(g)  # [B, H, N, C], [B, H, N, C, C]
    strict = jnp.tril(causal, -1)

    k_beta = k * beta[..., None]
    lower = jnp.where(strict, _einsum("...id,...jd->...ij", k_beta, k, bf16) * decay, 0.0)
    inv = unit_lower_inverse(lower, functools.partial(_einsum, "...ij,...jk->...ik", bf16=bf16))
    u = _einsum("...ij,...jd->...id", inv, v * beta[..., None], bf16)
    w = _einsum("...ij,...jd->...id", inv, k_beta * jnp.exp(cum)[..., None], bf16)

    last = cum[..., -1:]
    k_dec = k * jnp.exp(last - cum)[..., None]

    def step(s: jax.Array, inp: tuple[jax.Array, ...]) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        u_c, w_c, k_c, d_c = inp
        v_new = u_c - _einsum("bhck,bhkv->bhcv", w_c, s, bf16)
        s_next = s * d_c[..., None, None] + _einsum("bhck,bhcv->bhkv", k_c, v_new, bf16)
        return s_next, (s, v_new)

    xs = tuple(jnp.moveaxis(a, 2, 0) for a in (u, w, k_dec, jnp.exp(last[..., 0])))
    state, (starts, v_new) = jax.lax.scan(step, state.astype(jnp.float32), xs)
    starts, v_new = jnp.moveaxis(starts, 0, 2), jnp.moveaxis(v_new, 0, 2)  # [B, H, N, dk, dv], [B, H, N, C, dv]

    intra = jnp.where(causal, _einsum("...id,...jd->...ij", q, k, bf16) * decay, 0.0)
    o = (_einsum("...ck,...kv->...cv", q * jnp.exp(cum)[..., None], starts, bf16)
         + _einsum("...ij,...jv->...iv", intra, v_new, bf16))
    return from_chunks(o, t), state


def fused_gdn_parallel(mixed: jax.Array, *args: Any, **kwargs: Any) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``kernel.fused_gdn``'s signature and result over the state pools, in XLA: ``reference.fused_gdn_reference``
    with :func:`parallel_chunk_gated_delta_rule` as its chunked form, one bfloat16 pass per product when
    ``mixed`` is bfloat16 (the kernel's precision rule). Steps of at most ``RECURRENT_MAX_T`` tokens run the
    reference's recurrent form."""
    rule = functools.partial(parallel_chunk_gated_delta_rule, bf16=mixed.dtype == jnp.bfloat16)
    return fused_gdn_reference(mixed, *args, chunk_rule=rule, **kwargs)


def fused_gdn_xla_chunked(mixed: jax.Array, *args: Any, interpret: bool = False,
                          **kwargs: Any) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``--gdn-backend xla-chunked``: ``kernel.fused_gdn``'s signature and result, the fused Pallas kernel for
    steps of at most ``RECURRENT_MAX_T`` tokens (decode, a speculative verify and its commit: its recurrent
    form) and :func:`fused_gdn_parallel` for longer ones (prefill and extend steps, which the kernel runs in its
    chunked form). T is static, so each compiled step takes one of the two. ``interpret``: the kernel's."""
    if mixed.shape[1] <= RECURRENT_MAX_T:
        return fused_gdn(mixed, *args, interpret=interpret, **kwargs)
    return fused_gdn_parallel(mixed, *args, **kwargs)
