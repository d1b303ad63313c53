"""The Gated DeltaNet math in pure jnp: causal conv1d, the gated delta rule (recurrent and chunked), the
gated RMSNorm of its output. The model runs it off TPU and the fused kernel's reference wraps it, so both
import it from here (the kernel folder sits below the model).

Sources: Yang, Kautz, Hatamizadeh, "Gated Delta Networks", ICLR 2025 (the recurrence) and Yang et al.,
"Parallelizing Linear Transformers with the Delta Rule over Sequence Length", NeurIPS 2024 (the chunked
WY/UT form); HF ``Qwen3_5MoeGatedDeltaNet`` / ``Qwen3_5MoeRMSNormGated`` for the wiring.

Recurrence per value head, state ``S [dk, dv]``::

    S_t = exp(g_t) * S_{t-1}
    S_t = S_t + k_t (beta_t * (v_t - S_t^T k_t))^T
    o_t = S_t^T q_t

A token with ``g = 0, beta = 0, k = 0`` leaves ``S`` unchanged; padded tokens are masked that way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import jax
import jax.numpy as jnp

CHUNK_SIZE = 64


class GdnDims(Protocol):
    """The head layout :func:`gdn_mix` reads (a model config has these fields)."""

    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    gdn_key_dim: int


def causal_conv1d(
    x: jax.Array, conv_state: jax.Array, weight: jax.Array, new_lens: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Depthwise causal conv1d with SiLU, continuing from a carried state.

    Args:
        x: ``[B, T, C]`` new inputs (entries at ``t >= new_lens[b]`` are padding).
        conv_state: ``[B, C, K-1]`` the previous ``K-1`` inputs (oldest first); zeros at sequence start.
        weight: ``[C, K]`` depthwise kernel (HF ``conv1d.weight[:, 0, :]``).
        new_lens: ``[B]`` int32 valid inputs per row.

    Returns:
        ``(y [B, T, C] in x.dtype, new_state [B, C, K-1] in conv_state.dtype)``; the new state holds the last
        ``K-1`` valid inputs (unchanged when ``new_lens[b] == 0``).
    """
    t = x.shape[1]
    k = weight.shape[1]
    xs = jnp.concatenate([jnp.swapaxes(conv_state, 1, 2).astype(x.dtype), x], axis=1)  # [B, K-1+T, C]
    y = sum(xs[:, i : i + t, :] * weight[:, i].astype(x.dtype) for i in range(k))
    idx = new_lens[:, None] + jnp.arange(k - 1, dtype=jnp.int32)[None, :]  # [B, K-1]
    new_state = jnp.take_along_axis(xs, idx[:, :, None], axis=1)
    return jax.nn.silu(y), jnp.swapaxes(new_state, 1, 2).astype(conv_state.dtype)


def recurrent_gated_delta_rule(
    q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, state: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Token-by-token gated delta rule (used for decode, T == 1; also the test oracle).

    Args:
        q: ``[B, T, H, dk]`` float32, L2-normalised and scaled by ``dk^-0.5``.
        k: ``[B, T, H, dk]`` float32, L2-normalised.
        v: ``[B, T, H, dv]`` float32.
        g: ``[B, T, H]`` float32 log-decay (<= 0).
        beta: ``[B, T, H]`` float32 write strength in [0, 1].
        state: ``[B, H, dk, dv]`` float32 initial state.

    Returns:
        ``(o [B, T, H, dv] float32, final state [B, H, dk, dv] float32)``.
    """

    def step(s: jax.Array, inp: tuple[jax.Array, ...]) -> tuple[jax.Array, jax.Array]:
        q_t, k_t, v_t, g_t, b_t = inp  # [B, H, d], ..., [B, H]
        s = s * jnp.exp(g_t)[..., None, None]
        kv_mem = jnp.einsum("bhkv,bhk->bhv", s, k_t)
        delta = (v_t - kv_mem) * b_t[..., None]
        s = s + k_t[..., :, None] * delta[..., None, :]
        return s, jnp.einsum("bhkv,bhk->bhv", s, q_t)

    xs = tuple(jnp.moveaxis(a, 1, 0) for a in (q, k, v, g, beta))
    state, o = jax.lax.scan(step, state, xs)
    return jnp.moveaxis(o, 0, 1), state


def to_chunks(arrays: tuple[jax.Array, ...], chunk_size: int) -> tuple[jax.Array, ...]:
    """``[B, T, H, ...]`` arrays as ``[B, H, N, C, ...]`` chunks of ``C = chunk_size`` tokens, T padded with zeros
    to ``N * C`` (zero ``g``, ``beta`` and ``k`` tokens change nothing)."""
    b, t, h = arrays[0].shape[:3]
    pad = (-t) % chunk_size
    n = (t + pad) // chunk_size

    def chunked(a: jax.Array) -> jax.Array:
        a = jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))
        return jnp.moveaxis(a.reshape(b, n, chunk_size, h, *a.shape[3:]), 3, 1)

    return tuple(chunked(a) for a in arrays)


def from_chunks(o: jax.Array, t: int) -> jax.Array:
    """``[B, H, N, C, d]`` per-chunk outputs as ``[B, T, H, d]``, the padding tokens past ``t`` dropped."""
    b, h, n, c, d = o.shape
    return jnp.swapaxes(o.reshape(b, h, n * c, d)[:, :, :t], 1, 2)


def chunk_decays(g: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """From chunked log-decays ``g [B, H, N, C]`` float32: ``(cum [B, H, N, C]`` the in-chunk cumulative sums,
    ``decay [B, H, N, C, C]`` with ``decay[i, j] = exp(cum_i - cum_j)`` for ``i >= j`` and 0 above, ``causal
    [C, C]`` bool, the ``i >= j`` mask)."""
    c = g.shape[-1]
    cum = jnp.cumsum(g, axis=-1)
    causal = jnp.tril(jnp.ones((c, c), dtype=bool))
    # Mask before exp: the upper triangle holds positive exponents that could overflow.
    decay = jnp.exp(jnp.where(causal, cum[..., :, None] - cum[..., None, :], -jnp.inf))
    return cum, decay, causal


def chunk_gated_delta_rule(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    state: jax.Array,
    chunk_size: int = CHUNK_SIZE,
) -> tuple[jax.Array, jax.Array]:
    """Chunked (WY/UT) gated delta rule: same inputs and result as :func:`recurrent_gated_delta_rule`.

    Within a chunk of ``C`` tokens the delta-rule writes are condensed by solving the unit lower-triangular
    system ``(I + tril(diag(beta) K K^T * D, -1)) [U | W] = [diag(beta) V | diag(beta) K * exp(cum_g)]``
    (D the pairwise decays); chunks are then scanned sequentially with one state read and one write each.
    T is padded to a multiple of ``C`` with ``g = beta = k = 0`` tokens, which change nothing.
    """
    t, dv = k.shape[1], v.shape[-1]
    q, k, v, g, beta = to_chunks((q, k, v, g, beta), chunk_size)
    cum, decay, causal = chunk_decays(g)  # decay[i, j] = prod g over (j, i]

    k_beta = k * beta[..., None]
    v_beta = v * beta[..., None]
    hi = jax.lax.Precision.HIGHEST
    lower = jnp.einsum("...id,...jd->...ij", k_beta, k, precision=hi) * decay
    lower = jnp.where(jnp.tril(causal, -1), lower, 0.0)
    system = lower + jnp.eye(chunk_size, dtype=lower.dtype)
    rhs = jnp.concatenate([v_beta, k_beta * jnp.exp(cum)[..., None]], axis=-1)
    sol = jax.lax.linalg.triangular_solve(system, rhs, left_side=True, lower=True, unit_diagonal=True)
    u, w = sol[..., :dv], sol[..., dv:]  # u: pseudo-values, w: decayed keys that read the old state

    intra = jnp.einsum("...id,...jd->...ij", q, k, precision=hi) * decay
    q_dec = q * jnp.exp(cum)[..., None]
    k_dec = k * jnp.exp(cum[..., -1:] - cum)[..., None]
    chunk_decay = jnp.exp(cum[..., -1])  # [B, H, N]

    def step(s: jax.Array, inp: tuple[jax.Array, ...]) -> tuple[jax.Array, jax.Array]:
        u_c, w_c, q_c, k_c, a_c, d_c = inp
        v_new = u_c - jnp.einsum("bhck,bhkv->bhcv", w_c, s, precision=hi)
        o = jnp.einsum("bhck,bhkv->bhcv", q_c, s, precision=hi)
        o = o + jnp.einsum("bhij,bhjv->bhiv", a_c, v_new, precision=hi)
        s = s * d_c[..., None, None] + jnp.einsum("bhck,bhcv->bhkv", k_c, v_new, precision=hi)
        return s, o

    xs = tuple(jnp.moveaxis(a, 2, 0) for a in (u, w, q_dec, k_dec, intra, chunk_decay))
    state, o = jax.lax.scan(step, state, xs)  # o: [N, B, H, C, dv]
    return from_chunks(jnp.moveaxis(o, 0, 2), t), state


def gdn_mix(
    mixed: jax.Array,
    conv_weight: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    conv_state: jax.Array,
    rec_state: jax.Array,
    valid: jax.Array,
    new_lens: jax.Array,
    config: GdnDims,
    recurrent: bool = False,
    chunk_rule: Callable[..., tuple[jax.Array, jax.Array]] | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Causal conv1d + SiLU, q/k L2 norm and the gated delta rule (the part the fused kernel replaces).

    Args:
        mixed: ``[B, T, conv_dim]`` from :func:`gdn_projections`.
        conv_weight: ``[conv_dim, K]``.
        g, beta: ``[B, T, Hv]`` float32 (0 at padded tokens).
        conv_state: ``[B, conv_dim, K-1]``; rec_state: ``[B, Hv, dk, dv]`` (zeros at sequence start).
        valid: ``[B, T]`` bool; new_lens: ``[B]`` int32.
        config: the head layout (a model config, or any :class:`GdnDims`).
        recurrent: use the token-by-token form for every T (programs for XLA:CPU, where it is ~2x faster
            than the chunked form at prefill: the chunk's batched triangular solve and [C, C] decay
            matrices are slow there). Otherwise ``T == 1`` is recurrent and ``T > 1`` chunked.
        chunk_rule: the chunked form, with :func:`chunk_gated_delta_rule`'s signature (None: that one).

    Returns:
        ``(o [B, T, Hv, dv] float32, conv_state, rec_state)`` with the states in their input dtypes.
    """
    bsz, t, _ = mixed.shape
    hk, hv = config.linear_num_key_heads, config.linear_num_value_heads
    dk, dv = config.linear_key_head_dim, config.linear_value_head_dim
    mixed, conv_state = causal_conv1d(mixed, conv_state, conv_weight, new_lens)
    kd = config.gdn_key_dim
    q = mixed[..., :kd].reshape(bsz, t, hk, dk).astype(jnp.float32)
    k = mixed[..., kd : 2 * kd].reshape(bsz, t, hk, dk).astype(jnp.float32)
    v = mixed[..., 2 * kd :].reshape(bsz, t, hv, dv).astype(jnp.float32)
    # Value head h reads key head h // (Hv / Hk) (HF repeat_interleave).
    q = jnp.repeat(q, hv // hk, axis=2)
    k = jnp.repeat(k, hv // hk, axis=2)
    q = l2_normalize(q) * (dk**-0.5)
    k = l2_normalize(k)
    k = jnp.where(valid[..., None, None], k, 0.0)

    s0 = rec_state.astype(jnp.float32)
    if t == 1 or recurrent:
        o, s1 = recurrent_gated_delta_rule(q, k, v, g, beta, s0)
    else:
        o, s1 = (chunk_rule or chunk_gated_delta_rule)(q, k, v, g, beta, s0)
    return o, conv_state, s1.astype(rec_state.dtype)


def gated_rms_norm(x: jax.Array, gate: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """Gated RMSNorm of the Gated DeltaNet output: ``w * (x / rms(x)) * silu(gate)``.

    Args:
        x: ``[..., D]`` core output per head.
        gate: ``[..., D]`` the ``z`` projection for the same head.
        weight: ``[D]`` applied as a plain multiplier (not ``1 + w``).
        eps: added to the mean square.

    Returns:
        ``[..., D]`` in ``x.dtype``. Matches ``Qwen3_5MoeRMSNormGated`` (norm in fp32, cast, scale, gate in fp32).
    """
    dtype = x.dtype
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    y = weight * xf.astype(dtype)
    y = y.astype(jnp.float32) * jax.nn.silu(gate.astype(jnp.float32))
    return y.astype(dtype)


def l2_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """``x * rsqrt(sum(x^2) + eps)`` over the last axis (the FLA / HF ``l2norm`` convention), same dtype."""
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)
