"""Gated DeltaNet: chunked form vs recurrent form, masking of padded tokens, conv state carry-over."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from sglang_tpu_qwen.kernels.gdn import delta_rule as gdn
from sglang_tpu_qwen.kernels.gdn.delta_rule import l2_normalize

# Jitted once per shape: eager op-by-op dispatch of these functions is far slower than compiling them.
recurrent_gated_delta_rule = jax.jit(gdn.recurrent_gated_delta_rule)
chunk_gated_delta_rule = jax.jit(gdn.chunk_gated_delta_rule)
causal_conv1d = jax.jit(gdn.causal_conv1d)

TOL = 2e-5  # fp32; both forms compute the same recurrence, only the summation order differs


def _inputs(seed: int, b: int, t: int, h: int, dk: int, dv: int) -> tuple[jax.Array, ...]:
    # numpy RNG: compiling jax.random's threefry for these shapes costs seconds on CPU.
    rng = np.random.default_rng(seed)
    q = l2_normalize(jnp.asarray(rng.standard_normal((b, t, h, dk)), jnp.float32)) * dk**-0.5
    k = l2_normalize(jnp.asarray(rng.standard_normal((b, t, h, dk)), jnp.float32))
    v = jnp.asarray(rng.standard_normal((b, t, h, dv)), jnp.float32)
    # Mix of slow and fast decays, like -exp(A_log) * softplus(a + dt_bias).
    g = -jnp.exp(jnp.asarray(rng.uniform(-3.0, 1.5, (b, t, h)), jnp.float32))
    beta = jax.nn.sigmoid(jnp.asarray(rng.standard_normal((b, t, h)), jnp.float32))
    s0 = jnp.asarray(rng.standard_normal((b, h, dk, dv)) * 0.5, jnp.float32)
    return q, k, v, g, beta, s0


def _mask(valid: jax.Array, k: jax.Array, g: jax.Array, beta: jax.Array) -> tuple[jax.Array, ...]:
    return (
        jnp.where(valid[..., None, None], k, 0),
        jnp.where(valid[..., None], g, 0),
        jnp.where(valid[..., None], beta, 0),
    )


def test_chunked_matches_recurrent_with_initial_state() -> None:
    # T = 150 spans three chunks of 64 with a partial last chunk.
    q, k, v, g, beta, s0 = _inputs(0, b=2, t=150, h=3, dk=16, dv=8)
    o_ref, s_ref = recurrent_gated_delta_rule(q, k, v, g, beta, s0)
    o, s = chunk_gated_delta_rule(q, k, v, g, beta, s0)
    err_o = float(jnp.max(jnp.abs(o - o_ref)))
    err_s = float(jnp.max(jnp.abs(s - s_ref)))
    print(f"chunked vs recurrent: out {err_o:.2e}, state {err_s:.2e} (tol {TOL})")
    assert err_o < TOL and err_s < TOL
    assert float(jnp.max(jnp.abs(s - s0))) > 0.1  # the state really changed


def test_padded_tokens_leave_state_untouched() -> None:
    q, k, v, g, beta, s0 = _inputs(1, b=3, t=70, h=2, dk=8, dv=8)
    new_lens = jnp.array([70, 23, 0])
    valid = jnp.arange(70)[None, :] < new_lens[:, None]
    km, gm, bm = _mask(valid, k, g, beta)
    o, s = chunk_gated_delta_rule(q, km, v, gm, bm, s0)
    # Oracle: the recurrence over the valid prefix only.
    _, s_row1 = recurrent_gated_delta_rule(q[1:2, :23], k[1:2, :23], v[1:2, :23], g[1:2, :23], beta[1:2, :23], s0[1:2])
    o_row1, _ = recurrent_gated_delta_rule(q[1:2], km[1:2], v[1:2], gm[1:2], bm[1:2], s0[1:2])
    _, s_row0 = recurrent_gated_delta_rule(q[:1], k[:1], v[:1], g[:1], beta[:1], s0[:1])
    np.testing.assert_allclose(s[0], s_row0[0], atol=TOL)
    np.testing.assert_allclose(s[1], s_row1[0], atol=TOL)
    np.testing.assert_array_equal(np.asarray(s[2]), np.asarray(s0[2]))  # fully padded row: exact
    np.testing.assert_allclose(o[1, :23], o_row1[0, :23], atol=TOL)
    # Recurrent form with the same masking (decode path) also leaves the state exact.
    _, s_dec = recurrent_gated_delta_rule(q[:, :1], km[:, :1] * 0, v[:, :1], gm[:, :1] * 0, bm[:, :1] * 0, s0)
    np.testing.assert_array_equal(np.asarray(s_dec), np.asarray(s0))


def test_decode_steps_continue_chunked_prefill() -> None:
    q, k, v, g, beta, s0 = _inputs(2, b=1, t=40, h=2, dk=8, dv=4)
    o_all, s_all = chunk_gated_delta_rule(q, k, v, g, beta, s0)
    _, s = chunk_gated_delta_rule(q[:, :37], k[:, :37], v[:, :37], g[:, :37], beta[:, :37], s0)
    for i in range(37, 40):
        o_i, s = recurrent_gated_delta_rule(
            q[:, i : i + 1], k[:, i : i + 1], v[:, i : i + 1], g[:, i : i + 1], beta[:, i : i + 1], s
        )
        np.testing.assert_allclose(o_i[:, 0], o_all[:, i], atol=TOL)
    np.testing.assert_allclose(s, s_all, atol=TOL)


def test_conv_state_carried_across_calls_equals_one_shot() -> None:
    b, t, c, kk = 2, 11, 5, 4
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((b, t, c)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((c, kk)), jnp.float32)
    zero = jnp.zeros((b, c, kk - 1))
    y_all, st_all = causal_conv1d(x, zero, w, jnp.array([t, t]))
    # Oracle for the one-shot output: explicit causal correlation over a zero-padded input.
    xp = np.concatenate([np.zeros((b, kk - 1, c)), np.asarray(x)], axis=1)
    y_np = sum(xp[:, i : i + t, :] * np.asarray(w)[:, i] for i in range(kk))
    np.testing.assert_allclose(y_all, jax.nn.silu(y_np), atol=1e-5)
    np.testing.assert_allclose(st_all, np.swapaxes(np.asarray(x[:, -3:]), 1, 2), atol=0)

    # Split 2 + 1 + rest, with right padding in every call (row 1 padded more).
    st = zero
    outs = []
    for lo, hi in ((0, 2), (2, 3), (3, t)):
        chunk = jnp.pad(x[:, lo:hi], [(0, 0), (0, 3), (0, 0)], constant_values=7.0)  # garbage padding
        y, st = causal_conv1d(chunk, st, w, jnp.array([hi - lo, hi - lo]))
        outs.append(y[:, : hi - lo])
    np.testing.assert_allclose(jnp.concatenate(outs, axis=1), y_all, atol=1e-5)
    np.testing.assert_allclose(st, st_all, atol=0)

    # new_len 0 keeps the state.
    _, st_same = causal_conv1d(jnp.ones((b, 3, c)), st_all, w, jnp.array([0, 0]))
    np.testing.assert_array_equal(np.asarray(st_same), np.asarray(st_all))
