"""Fused conv1d + Gated DeltaNet (Pallas TPU kernel) for a batch of sequences, states updated in place.

Math: Gated DeltaNet (Yang, Kautz, Hatamizadeh, ICLR 2025) in the chunked WY/UT form of Yang et al.
("Parallelizing Linear Transformers with the Delta Rule over Sequence Length", NeurIPS 2024), exactly as
``model.gated_deltanet`` (the reference): depthwise causal conv1d (kernel K = 4) + SiLU over the q|k|v
channels, q/k L2-normalised (q scaled by dk^-0.5), then per value head, state ``S [dk, dv]``::

    S' = exp(g_t) S_{t-1}
    S_t = S' + k_t (beta_t (v_t - S'^T k_t))^T
    o_t = S_t^T q_t

Prefill (T > 1) runs chunks of C tokens (``chunk_size``, default 64): with ``cum`` the in-chunk cumulative
log-decay, ``D[i, j] = exp(cum_i - cum_j)`` (i >= j) and ``L = tril(diag(beta) K K^T * D, -1)``, the chunk's
writes are ``U = (I + L)^-1 diag(beta) V`` and ``W = (I + L)^-1 diag(beta) K exp(cum)``; the inverse of the unit
lower triangular matrix comes from recursive block inversion (``kernels/gdn/unit_lower_inverse.py``): ten C x C
products at C = 64 (twelve at 128) on the MXU instead of a C-step sequential substitution, every intermediate a
block of the inverse (the nilpotent product ``(I - L)(I + L^2)...`` it replaced overflowed on a repeated token).
Then ``V' = U - W S``, ``O = (Q exp(cum)) S + (tril(Q K^T * D)) V'`` and
``S <- exp(cum_C) S + (K exp(cum_C - cum))^T V'``.

Precision of the chunked form follows the model's compute dtype (``mixed.dtype``). A float32 model runs the
chunk's products at ``HIGHEST`` (six bfloat16 MXU passes). A bfloat16 model runs them in one pass over
bfloat16-rounded operands with float32 accumulation, as FLA's chunked kernels do for bf16 models; only the
cumulative log-decay stays float32-exact (:func:`_cumsum_rows`). The products form a chain of dependent 64 x 64
MXU ops, so passes are latency: the deviceless v5e schedule of one chunk of one value head (35B layout) was
~615 bundles against ~2,700 at ``HIGHEST`` (with the nilpotent product; the block inverse added ~8%: a 64-token
grid step of two value heads 2,179 -> 2,346 bundles). Outputs and states then differ from the float32 reference by
~3e-3 relative rms (bf16 rounding level; tests/test_kernels_gdn.py). State accumulation stays float32.

The chunked form runs in two phases per grid step. First, for every (value head, chunk) pair of the step, what
does not depend on the state (the decays, ``L`` and its inverse, ``U``, ``W``, the decayed q and k, the intra-chunk
scores; ``Q K^T`` once per key head, shared by its value heads) as straight-line code into VMEM scratch: the
pairs are independent chains the scheduler may overlap. Then the chunks in order, every value head's three state
products per chunk side by side. Key heads are grouped per grid step up to ``CHUNK_CHAINS`` = 16 pairs
(:func:`chunk_heads`: 8 key heads a step for the 35B layout's 64-token blocks, 2 for 256-token blocks).

Decode and short steps (``T <= RECURRENT_MAX_T`` = 8: a decode step, a speculative verify step's k + 1 tokens
and its commit) run the recurrence directly, token by token on the VPU (``_decode_head``: multiplies and
sublane sums in float32, no MXU pass). Each token's arithmetic is a decode step's, and the state is carried
between tokens in the pool's dtype (the state block with commit, registers without), so T tokens in one call
compute what T decode calls compute (a bf16 state rounded after each token as each decode step rounds it on
store): a verify step's outputs are a plain decode's, token for token. The chunked form would pad such a step
to a 64-token chunk and solve 64 x 64 systems for it. A short step is bound by its on-chip work, not bandwidth
(4 tokens: ~4x a decode step's arithmetic for one read of the state); with commit its schedule is laid out for
overlap: tokens outer and every key head of the step inner (one branch per token, so that a commit skips its
rejected tokens; the heads' chains interleave). The lane-replicated k
and q of every token come from the MXU, which the recurrence leaves idle (``_lane_replicated``: a bfloat16
product of the step's k|q rows split into three bfloat16 parts cut toward zero with a 0/1 selector, the
float32 values bit for bit, -0.0 as +0.0); they were lane broadcasts on the XLU, 32 a token and key head, one
every ~8 cycles on each of its 3 units, which bounded the step. Deviceless v5e schedule of one 2 MiB grid step
(35B layout, float32 state, ``dev/gdn_llo.py``): 4 tokens without commit 9,037 -> 7,706 bundles, with commit
8,977 -> 7,679, a decode step (1 MiB) 1,509 -> 1,256; what is left is the VPU arithmetic (~5,100 bundles of it)
and spill traffic (the scheduler pops the products early). Earlier: 7,201 -> 4,718 bundles a 1 MiB grid step
for the token-outer order, one transpose of k|q and the conv taps below.

``commit=False`` (a speculative verify step) reads the pools and writes nothing: the recurrent state enters
through its input block (no state output, no aliasing), and the conv windows are not scattered back. Its tokens
run value head by value head (:func:`_verify_heads`), each head's state carried in registers between tokens
where the committing form stores it to VMEM and loads it back every token: the same arithmetic token for token,
7,706 -> 7,084 bundles a 2 MiB grid step at 64 x 4 (deviceless v5e, ``tools/plan/kernel_schedule --no-commit``;
the VPU's stores were 76% busy; 7,020 since a padding row takes a branch of its own that runs its token 0).
The commit program then calls the kernel again over the same inputs with ``new_lens`` the accepted counts (tokens
past them are padding), and ``kernels/gdn/slot_copy.py`` copies the rows that take a decode snapshot slot to
slot by DMA.

Layout and grid. One grid step is (sequence b, group of key heads, block of ``block_t`` tokens); the
``r = Hv / Hk`` value heads that share a key head are handled together, so q/k are convolved and
normalised once for all of them (the index maps below are written for one key head a step; a group of
consecutive key heads acts as one wider key head). Any r and any dk, dv run (released: r = 1, 2, 3, 4 at
dk = dv = 128); on a TPU, Mosaic needs dk and dv to be multiples of 128.
Inputs are read straight from the model's arrays:

    mixed        [B, T, conv_dim]    pre-conv q|k|v channels (q: kh*dk.., k: (Hk+kh)*dk.., v: 2*Hk*dk + kh*r*dv..)
    conv_weight  [conv_dim, K]       (the recurrent form's enters as [K, conv_dim] float32, by XLA)
    g, beta      [B, T, Hv] float32  log-decay and write strength (0 at padded tokens)
    conv_pool    [L, S*(K-1), C/128, 128]  all GDN layers' conv windows (kernels/gdn/conv_pool.py)
    rec_pool     [L, S, Hv, dk, dv]      recurrent states, fp32 (default) or bf16, aliased in -> out
    layer, slot_ids [B], new_lens [B], fresh [B]: scalar-prefetched (SMEM)

A group's v channels start at ``2 * Hk * dk + kh * r * dv``: a whole block of width ``r * dv`` when the
q|k width is a multiple of it, else an element-offset window (``_v_group_specs``; Qwen3.5-27B, r = 3).
The recurrent state block of (layer, slot_ids[b], kh) is selected by the BlockSpec index map from the
prefetched slot ids and stays resident in VMEM across the token blocks (its index does not depend on the
token axis), so each state is read once and written once per call, in place. The conv window (K-1
inputs per channel) enters as the batch's ``[B, K-1, conv_dim]`` rows of the pool (taps-major,
lane-dense), gathered by one DMA per row (``kernels/gdn/window_copy.py``; XLA's gather and scatter of them
ran at ~170 GB/s on the v5e) and relaid out by XLA into the kernel's blocks (handing the pool itself to Mosaic
made XLA copy all of it around the call: 8.9 GiB at 45 layers x 33 slots). The window
lives in a resident output block across token blocks and is scattered back into the pool by one DMA per row
after the kernel (B x 3 x conv_dim values per layer, <0.3% of a row's state bytes).

``block_t`` (default 256, a multiple of C) bounds VMEM: at Qwen3.5-397B shapes (dk = dv = 128, r = 4) a
step holds about 2.5 MiB of token tiles plus a 256 KiB state, far under Ironwood's 64 MiB, leaving room
for double buffering; 256 tokens amortise the per-step overhead over four chunks. The recurrent form takes
one grid step per (sequence, group of key heads), one token block of all T tokens (a block dim equal to the
array's, so any T tiles); key heads are grouped up to ``DECODE_STATE_BYTES`` of state per step at T = 1 and
``SHORT_STATE_BYTES`` at T > 1 (:func:`decode_heads`), and the state block dominates the step's traffic.

Padded tokens (``t >= new_lens[b]``) have ``k = g = beta = 0`` and so change nothing; their outputs are
finite but meaningless. ``fresh[b]`` makes the kernel read both states of the row as zeros.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from sglang_tpu_qwen.kernels.gdn.delta_rule import gated_rms_norm
from sglang_tpu_qwen.kernels.gdn.unit_lower_inverse import unit_lower_inverses
from sglang_tpu_qwen.kernels.gdn.window_copy import gather_windows_dma, scatter_windows_dma
from sglang_tpu_qwen.utils.mxu_precision import HIGHEST, ONE_PASS

CHUNK_SIZE = 64
# Decode: recurrent-state bytes per grid step (key heads are grouped up to it). A step of one key head
# (256 KiB at the 397B's layout) spent more time in per-step overhead than in its copies.
DECODE_STATE_BYTES = 1 << 20
# Short steps (the recurrent form at T > 1: a speculative verify's k + 1 tokens and its commit) take twice that:
# on the v5e (35B layout, 64 rows x 4 tokens, 2026-12-07) verify / commit took 611 / 642 us with 1 MiB a grid
# step and 557 / 598 us with 2 MiB (733 us with 512 KiB): each grid step has a fixed cost their VPU work does
# not hide.
SHORT_STATE_BYTES = 2 << 20
# Chunked form: (value head, chunk) pairs per grid step (key heads are grouped up to it): their state-independent
# products are independent chains, one at a time left the MXU waiting on each product's result. On the v5e (35B
# layout, 2026-12-07) 16 pairs took 693 / 670 / 635 us at 32 x 64 / 8 x 256 / 1 x 2,048 tokens against 8 pairs'
# 801 / 837 / 840 us.
CHUNK_CHAINS = 16
# Steps of at most this many tokens per row run the recurrent form (a speculative verify's k + 1 tokens): the
# chunked form would pad them to a 64-token chunk and solve 64 x 64 systems for 4 tokens.
RECURRENT_MAX_T = 8
# Name scopes of the two forms' pallas_calls: the planner charges each form's declared flops at the chip's
# measured rate for it (tools/plan/chips.py; the recurrent form runs on the VPU).
RECURRENT_SCOPE = "gdn_recurrent"
CHUNKED_SCOPE = "gdn_chunked"
_NN = (((1,), (0,)), ((), ()))
_NT = (((1,), (1,)), ((), ()))
_TN = (((0,), (0,)), ((), ()))


def _dot(a: jax.Array, b: jax.Array, dims=_NN, bf16: bool = False) -> jax.Array:
    """float32 product of two float32 tiles: one MXU pass over bfloat16-rounded operands with ``bf16``, else
    ``HIGHEST`` (six passes)."""
    if bf16:
        return jax.lax.dot_general(a.astype(jnp.bfloat16), b.astype(jnp.bfloat16), dims, precision=ONE_PASS,
                                   preferred_element_type=jnp.float32)
    return jax.lax.dot_general(a, b, dims, precision=HIGHEST, preferred_element_type=jnp.float32)


def _cumsum_rows(causal: jax.Array, g: jax.Array, bf16: bool) -> jax.Array:
    """In-chunk cumulative sum of ``g [C, 1]`` float32 as ``[C, 128]`` equal lanes: a triangular matmul (Mosaic
    has no cumsum). The 0/1 mask is exact in bfloat16, so with ``bf16`` three passes over ``g`` split into
    three bfloat16 parts (24 mantissa bits) keep the log-decays float32-exact where ``HIGHEST`` takes six."""
    g = jnp.broadcast_to(g, (g.shape[0], 128))
    if not bf16:
        return _dot(causal.astype(jnp.float32), g)
    mask, total = causal.astype(jnp.bfloat16), None
    for _ in range(3):
        part = g.astype(jnp.bfloat16)
        g = g - part.astype(jnp.float32)
        term = jax.lax.dot_general(mask, part, _NN, precision=ONE_PASS, preferred_element_type=jnp.float32)
        total = term if total is None else total + term
    return total


def _l2norm(x: jax.Array) -> jax.Array:
    """Same convention as ``delta_rule.l2_normalize`` (eps 1e-6 inside the rsqrt)."""
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + 1e-6)


def _gated_rms_norm(o: jax.Array, gate: jax.Array, weight: jax.Array, eps: float, out_dtype, round_product: bool):
    """``delta_rule.gated_rms_norm`` of one head's ``[rows, dv]`` float32 output, op for op (same roundings)."""
    x = o.astype(out_dtype).astype(jnp.float32)
    x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
    y = weight * x.astype(out_dtype).astype(jnp.float32)  # exact in f32: both factors have <= 8-bit mantissas
    if round_product:  # the reference multiplies in out_dtype
        y = y.astype(out_dtype).astype(jnp.float32)
    return (y * jax.nn.silu(gate)).astype(out_dtype)


def _kernel(
    _layer_ref, _slot_ref, len_ref, fresh_ref,  # scalar prefetch (layer and slots feed the index map)
    *refs, dk: int, dv: int, r: int, heads: int, chunk: int, norm: tuple[float, bool] | None, recurrent: bool,
    commit: bool, bf16: bool,
):
    # One step holds ``heads`` key heads and their ``heads * r`` value heads (decode_heads, chunk_heads).
    # Inputs (+ gate and norm weight when the output norm is fused), outputs (rec_ref aliased to the recurrent
    # pool; without ``commit`` there is no state output and rec_ref is the chunked form's last scratch buffer,
    # None in the recurrent form), scratch (acc: the block's float32 output before the norm; the chunked form's
    # per-chunk results).
    n_in = 14 if norm else 12
    xq_ref, xk_ref, xv_ref, wq_ref, wk_ref, wv_ref, g_ref, beta_ref, cq_in, ck_in, cv_in, rec_in = refs[:12]
    gate_ref, nw_ref = refs[12:n_in] if norm else (None, None)
    o_out, cq, ck, cv = refs[n_in : n_in + 4]
    if commit:
        rec_ref, scratch = refs[n_in + 4], refs[n_in + 5 :]
    elif recurrent:  # a verify step's recurrent form keeps its states in registers (_verify_heads)
        rec_ref, scratch = None, refs[n_in + 4 :]
    else:
        rec_ref, scratch = refs[-1], refs[n_in + 4 : -1]
    sq, sk, sv, qn, kn, vn, o_ref = scratch[:7]
    b, tb = pl.program_id(0), pl.program_id(2)
    block_t = xq_ref.shape[0]
    fresh = fresh_ref[b] != 0
    # Valid tokens of this row inside this token block.
    n = jnp.clip(len_ref[b] - tb * block_t, 0, block_t)

    @pl.when(tb == 0)
    def _load_states():
        # The recurrent form reads its state straight from rec_in (one pass over it, below).
        for src, dst in ((cq_in, cq), (ck_in, ck), (cv_in, cv)) + (() if recurrent else ((rec_in, rec_ref),)):
            dst[...] = jnp.where(fresh, 0, src[...])

    def conv(x_ref, w_ref, win_ref, xs_ref):
        """SiLU(causal depthwise conv) of this block's inputs; carries the K-1 input window in win_ref."""
        km1 = win_ref.shape[0]
        xs_ref[0:km1, :] = win_ref[...].astype(jnp.float32)
        xs_ref[km1:, :] = x_ref[...].astype(jnp.float32)
        wt = w_ref[...].astype(jnp.float32)
        if not recurrent:
            wt = wt.T  # [K, channels]; the recurrent form's taps enter so
        y = xs_ref[0:block_t, :] * wt[0:1, :]
        for i in range(1, km1 + 1):
            y = y + xs_ref[i : i + block_t, :] * wt[i : i + 1, :]
        for i in range(km1):  # the last K-1 valid inputs; row by row (Mosaic loads one unaligned row)
            win_ref[i : i + 1, :] = xs_ref[pl.ds(n + i, 1), :].astype(win_ref.dtype)
        return y * jax.nn.sigmoid(y)

    valid = jax.lax.broadcasted_iota(jnp.int32, (block_t, 1), 0) < n
    q_all, k_all = conv(xq_ref, wq_ref, cq, sq), conv(xk_ref, wk_ref, ck, sk)
    for j in range(heads):  # q/k are L2-normalised per key head
        keys = slice(j * dk, (j + 1) * dk)
        qn[:, keys] = _l2norm(q_all[:, keys]) * (dk**-0.5)
        kn[:, keys] = jnp.where(valid, _l2norm(k_all[:, keys]), 0.0)
    vn[...] = conv(xv_ref, wv_ref, cv, sv)

    if recurrent:
        # Decode and short steps (a speculative verify's k + 1 tokens): token by token, each exactly a decode
        # step's arithmetic (_decode_head), the state carried between tokens in the pool's dtype (so a bf16 state
        # is rounded after each token, as T decode steps round it on store): in rec_ref with commit, in registers
        # without (_verify_heads).
        # k and q lane-replicated ([dk, dv], row i all k_i) for _decode_head, made by the otherwise idle MXU
        # (_lane_replicated): the XLU's lane broadcasts bound the step before.
        # q of tokens past the row's length zeroed like their k: a non-finite value would spread to its channel's
        # other columns through the product's zeros (such tokens' outputs are zeros).
        parts_t = _split_columns(jnp.concatenate([kn[...], jnp.where(valid, qn[...], 0.0)], axis=0))
        if not commit:
            verify = functools.partial(_verify_heads, parts_t, rec_in, vn, g_ref, beta_ref, o_ref, fresh, n, heads,
                                       r, dk, dv, rec_in.dtype)
            pl.when(n > 0)(functools.partial(verify, block_t))
            # A padding row computes its token 0 only, as the committing form does (a bucket's padding rows).
            pl.when(n == 0)(functools.partial(verify, 1))
            o_out[...] = o_ref[...]
            return

        def token(i: int, j: int) -> None:
            keys = slice(j * dk, (j + 1) * dk)
            k_col, q_col = _lane_replicated(parts_t[keys, :], i, block_t + i, dv)
            for h in range(j * r, (j + 1) * r):
                lanes = slice(h * dv, (h + 1) * dv)
                s0 = jnp.where(fresh, 0.0, rec_in[h].astype(jnp.float32)) if i == 0 else \
                    rec_ref[h].astype(jnp.float32)
                s, o_ref[i : i + 1, lanes] = _decode_head(s0, k_col, q_col, vn[i : i + 1, lanes],
                                                          g_ref[i : i + 1, h : h + 1], beta_ref[i : i + 1, h : h + 1])
                rec_ref[h] = s.astype(rec_ref.dtype)

        def all_heads(i: int) -> None:
            for j in range(heads):
                token(i, j)

        def skip(i: int) -> None:
            o_ref[i : i + 1, :] = jnp.zeros((1, heads * r * dv), jnp.float32)

        all_heads(0)  # always: it moves the state from rec_in into rec_ref (a padded token changes nothing)
        for i in range(1, block_t):
            # Tokens past new_lens (a commit's rejected drafts, a short row) are skipped, not computed: their
            # zero k, g and beta would leave the state as it is. The per-token arithmetic bounds a grid step at
            # T > 1, so a commit costs its accepted tokens. Their outputs are zeros.
            pl.when(i < n)(functools.partial(all_heads, i))
            pl.when(i >= n)(functools.partial(skip, i))
        o_out[...] = o_ref[...]
        return

    # The chunked form in two phases. (1) What does not depend on the state, for every chunk of the block and
    # every value head: straight-line code, so the scheduler can overlap these independent chains of dependent
    # 64 x 64 products (one chain at a time left the MXU waiting on each product's result). (2) The chunks in
    # order, each value head's state products per chunk side by side.
    nh, nc = heads * r, block_t // chunk
    prep = scratch[7:]  # [nc, nh, ...]: u, w, q decayed, k decayed, intra, the chunk's decay

    @pl.when(n > 0)  # a padding row, or a token block past the row's end, computes nothing
    def _prepare_chunks():
        # Every chunk of the block (one basic block; past n they are padding) and every value head.
        pairs = [(c, j, h) for c in range(nc) for j in range(heads) for h in range(j * r, (j + 1) * r)]
        _chunk_prepare(pairs, dk, dv, chunk, qn, kn, vn, g_ref, beta_ref, prep, bf16)

    o_ref[...] = jnp.zeros_like(o_ref)  # tokens past the valid chunks

    def chunk_in_order(c, states):
        return _chunk_apply(c, states, dv, chunk, prep, o_ref, bf16)

    states = jax.lax.fori_loop(0, jax.lax.div(n + chunk - 1, chunk), chunk_in_order,
                               tuple(rec_ref[h].astype(jnp.float32) for h in range(nh)))
    for h in range(nh):
        lanes = slice(h * dv, (h + 1) * dv)
        rec_ref[h] = states[h].astype(rec_ref.dtype)
        if norm:
            gate = gate_ref[:, lanes].astype(jnp.float32)
            o_out[:, lanes] = _gated_rms_norm(o_ref[:, lanes], gate, nw_ref[...].astype(jnp.float32), norm[0],
                                              o_out.dtype, norm[1])
    if not norm:
        o_out[...] = o_ref[...]


def _bf16_toward_zero(x: jax.Array) -> jax.Array:
    """float32 ``x`` with the low 16 bits of its encoding cleared: the bfloat16 value next to it toward zero (exactly
    representable in bfloat16), and ``x`` minus it an exact float32 of the same sign."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32) & jnp.uint32(0xFFFF0000)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _split_columns(x: jax.Array) -> jax.Array:
    """For :func:`_lane_replicated`: ``x [n, c]`` float32 as ``[c, 3n]`` bfloat16, its rows' three bfloat16 parts
    (high, middle, low) transposed: column ``p * n + m`` holds part p of row m.

    The parts are cut toward zero (:func:`_bf16_toward_zero`), so they share x's sign and hold disjoint runs of its
    24 significant bits (8, then up to 8 of the remainder, then the rest): every partial sum of them is a truncation
    of x, a float32, and their float32 sum is x in any order. (Rounded to nearest, the high and low parts could
    take opposite signs and their sum a 25th bit.) Exact for finite x whose parts stay normal (|x| >= 2^-102 or 0:
    smaller parts are subnormal, which the TPU flushes, as its arithmetic does such inputs anyway); -0.0 comes back
    +0.0."""
    hi = _bf16_toward_zero(x)
    mid = _bf16_toward_zero(x - hi)
    return jnp.concatenate([hi, mid, x - hi - mid], axis=0).T.astype(jnp.bfloat16)


def _lane_replicated(parts_t: jax.Array, a: int, b: int, dv: int) -> tuple[jax.Array, jax.Array]:
    """Columns ``a`` and ``b`` of the split matrix (:func:`_split_columns`; ``parts_t [rows, 3n]``) each replicated
    across ``dv`` lanes, ``([rows, dv], [rows, dv])`` float32, the float32 values (within :func:`_split_columns`'
    range): one bfloat16 MXU product with a ``[3n, 2 dv]`` 0/1 selector, whose float32 accumulation adds each
    value's three exact parts and zeros (a non-finite value in a row makes the row's other columns NaN too). It
    replaces the XLU's lane broadcasts (module docstring)."""
    n = parts_t.shape[1] // 3
    part_row = jax.lax.broadcasted_iota(jnp.int32, (3 * n, 2 * dv), 0) % n
    col = jax.lax.broadcasted_iota(jnp.int32, (3 * n, 2 * dv), 1)
    sel = jnp.where(part_row == jnp.where(col < dv, a, b), 1.0, 0.0).astype(jnp.bfloat16)
    both = jax.lax.dot_general(parts_t, sel, _NN, precision=ONE_PASS, preferred_element_type=jnp.float32)
    return both[:, :dv], both[:, dv:]


def _decode_head(s0: jax.Array, k: jax.Array, q: jax.Array, v: jax.Array, g: jax.Array,
                 beta: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One value head's decode step on the VPU: ``s0 [dk, dv]`` float32, ``k``/``q`` lane-replicated
    ``[dk, dv]`` (``k[i, :]`` all ``k_i``), ``v [1, dv]``, ``g``/``beta [1, 1]``; returns
    ``(S_t, o_t [1, dv])``: the module docstring's recurrence, with ``k^T (e^g S) = e^g (k^T S)``.

    The products with one token are multiplies and sublane sums in float32: a one-row MXU matmul at HIGHEST
    precision would push ``S`` through the MXU six times per product, three products per head.
    """
    decay = jnp.exp(g)
    delta = (v - decay * jnp.sum(s0 * k, axis=0, keepdims=True)) * beta
    s = s0 * decay + k * delta
    return s, jnp.sum(s * q, axis=0, keepdims=True)


def _verify_heads(parts_t: jax.Array, rec_in, vn, g_ref, beta_ref, o_ref, fresh: jax.Array, n: jax.Array,
                  heads: int, r: int, dk: int, dv: int, state_dtype: jnp.dtype, tokens: int) -> None:
    """A speculative verify step's recurrent form (no state written) over a grid step's ``heads`` key heads:
    each value head's first ``tokens`` tokens in turn, its state carried in registers between them, where the
    committing form stores it to VMEM and loads it back each token (the VPU's stores were 76% busy). Each token
    is :func:`_decode_head` on the state rounded to ``state_dtype`` as a decode step's store rounds it, so the
    outputs are the committing form's bit for bit: token 0 always, a token at or past the row's ``n`` valid ones
    zeros (what it computes from its zero k, g and beta reaches no valid output: those come before it), and so
    is every token past ``tokens``.

    Refs and values: ``parts_t [heads * dk, 6T]`` bfloat16 (:func:`_split_columns` of the step's k and q rows);
    ``rec_in [heads * r, dk, dv]`` the states in the pool's dtype ``state_dtype``; ``vn`` and ``o_ref
    [T, heads * r * dv]`` float32 (the convolved v; the outputs); ``g_ref``, ``beta_ref [T, heads * r]`` float32;
    ``fresh`` a bool scalar (the states read as zeros), ``n`` an int32 scalar."""
    t = vn.shape[0]
    if tokens < t:
        o_ref[tokens:, :] = jnp.zeros((t - tokens, o_ref.shape[1]), jnp.float32)
    for j in range(heads):
        keys = slice(j * dk, (j + 1) * dk)
        cols = [_lane_replicated(parts_t[keys, :], i, t + i, dv) for i in range(tokens)]
        for h in range(j * r, (j + 1) * r):
            lanes = slice(h * dv, (h + 1) * dv)
            s = jnp.where(fresh, 0.0, rec_in[h].astype(jnp.float32))
            for i in range(tokens):
                s, o = _decode_head(s, *cols[i], vn[i : i + 1, lanes], g_ref[i : i + 1, h : h + 1],
                                    beta_ref[i : i + 1, h : h + 1])
                o_ref[i : i + 1, lanes] = o if i == 0 else jnp.where(i < n, o, 0.0)
                s = s.astype(state_dtype).astype(jnp.float32)


def _chunk_prepare(pairs: list[tuple[int, int, int]], dk: int, dv: int, chunk: int, qn, kn, vn, g_ref, beta_ref,
                   prep, bf16: bool) -> None:
    """The state-independent part of the WY/UT form (module docstring) for every ``(chunk c, key head j, value
    head h)`` of ``pairs``: from the normalised ``qn``/``kn [block_t, heads * dk]``, ``vn [block_t, heads * r * dv]``
    and ``g``/``beta [block_t, heads * r]`` float32, writes ``U``, ``W``, ``Q exp(cum)``, ``K exp(cum_C - cum)``,
    ``tril(Q K^T * D)`` and ``exp(cum_C)`` into ``prep[...][c, h]``.

    Each step is emitted for every pair before the next step (breadth first): the MXU takes products in program
    order, so a pair's chain of dependent products (the inverse's ten, then U and W) emitted whole left it idle
    on each result, where independent products of the other pairs now fill the waits. A pair's arithmetic is the
    same either way.
    """
    u_ref, w_ref, qd_ref, kd_ref, intra_ref, last_ref = prep
    row = jax.lax.broadcasted_iota(jnp.int32, (chunk, chunk), 0)
    col = jax.lax.broadcasted_iota(jnp.int32, (chunk, chunk), 1)
    causal, strict = row >= col, row > col

    def tok(c: int) -> slice:
        return slice(c * chunk, (c + 1) * chunk)

    def keys(j: int) -> slice:
        return slice(j * dk, (j + 1) * dk)

    def lanes(h: int) -> slice:
        return slice(h * dv, (h + 1) * dv)

    # Q K^T once per (chunk, key head), shared by its value heads.
    qk = {(c, j): _dot(qn[tok(c), keys(j)], kn[tok(c), keys(j)], _NT, bf16) for c, j in dict.fromkeys(
        (c, j) for c, j, _ in pairs)}
    # In-chunk cumulative sums as triangular matmuls (Mosaic has no cumsum); 128 equal lanes, then transposed to
    # get the same values along a row.
    cums = [_cumsum_rows(causal, g_ref[tok(c), h : h + 1], bf16) for c, _, h in pairs]
    k_betas, decays, lowers = [], [], []
    for (c, j, h), cum_b in zip(pairs, cums, strict=True):
        cum, cum_row = cum_b[:, :1], cum_b.T[:1, :]
        # Mask before exp: the upper triangle holds positive exponents that could overflow.
        decays.append(jnp.where(causal, jnp.exp(jnp.where(causal, cum - cum_row, 0.0)), 0.0))
        k_betas.append(kn[tok(c), keys(j)] * beta_ref[tok(c), h : h + 1])
        lowers.append(_dot(k_betas[-1], kn[tok(c), keys(j)], _NT, bf16))
    lowers = [jnp.where(strict, lower * decay, 0.0) for lower, decay in zip(lowers, decays, strict=True)]
    invs = unit_lower_inverses(lowers, functools.partial(_dot, dims=_NN, bf16=bf16))
    for (c, _, h), cum_b, inv, k_beta in zip(pairs, cums, invs, k_betas, strict=True):
        u_ref[c, h] = _dot(inv, vn[tok(c), lanes(h)] * beta_ref[tok(c), h : h + 1], _NN, bf16)
        w_ref[c, h] = _dot(inv, k_beta * jnp.exp(cum_b[:, :1]), _NN, bf16)
    for (c, j, h), cum_b, decay in zip(pairs, cums, decays, strict=True):
        cum, last = cum_b[:, :1], cum_b[chunk - 1 :, :1]
        qd_ref[c, h] = qn[tok(c), keys(j)] * jnp.exp(cum)
        kd_ref[c, h] = kn[tok(c), keys(j)] * jnp.exp(last - cum)
        intra_ref[c, h] = jnp.where(causal, qk[c, j] * decay, 0.0)
        last_ref[c, h] = jnp.broadcast_to(jnp.exp(last), last_ref.shape[2:])


def _chunk_apply(c, states: tuple[jax.Array, ...], dv: int, chunk: int, prep, o_ref,
                 bf16: bool) -> tuple[jax.Array, ...]:
    """Chunk ``c`` (traced) of every value head from its state ``states[h] [dk, dv]`` float32 before it: writes the
    chunk's outputs into ``o_ref`` and returns the states after it (module docstring). Emitted breadth first
    across the heads, as :func:`_chunk_prepare`."""
    u_ref, w_ref, qd_ref, kd_ref, intra_ref, last_ref = prep
    heads = range(len(states))
    tok = pl.ds(pl.multiple_of(c * chunk, chunk), chunk)
    w_s = [_dot(w_ref[c, h], states[h], _NN, bf16) for h in heads]
    q_s = [_dot(qd_ref[c, h], states[h], _NN, bf16) for h in heads]
    v_new = [u_ref[c, h] - w_s[h] for h in heads]
    for h in heads:
        o_ref[tok, h * dv : (h + 1) * dv] = q_s[h] + _dot(intra_ref[c, h], v_new[h], _NN, bf16)
    return tuple(states[h] * last_ref[c, h][0:1, 0:1] + _dot(kd_ref[c, h], v_new[h], _TN, bf16) for h in heads)


def chunk_heads(hk: int, r: int, chunks: int, chains: int) -> int:
    """Key heads per grid step of the chunked form: the largest divisor of ``hk`` whose ``heads * r`` value heads
    times the block's ``chunks`` stay within ``chains`` independent chunk chains; at least 1."""
    return max(h for h in range(1, hk + 1) if hk % h == 0 and (h == 1 or h * r * chunks <= chains))


def decode_heads(hk: int, r: int, dk: int, dv: int, itemsize: int, budget: int) -> int:
    """Key heads per decode grid step: the largest divisor of ``hk`` whose ``heads * r`` value heads' states
    (``dk x dv`` of ``itemsize`` bytes each) fit ``budget`` bytes; at least 1."""
    per_head = r * dk * dv * itemsize
    return max(h for h in range(1, hk + 1) if hk % h == 0 and (h == 1 or h * per_head <= budget))


def _weight_spec(k: int | pl.Element, width: int | pl.Element, index, taps_major: bool) -> pl.BlockSpec:
    """BlockSpec of ``width`` channels of the conv weight from channel block (or element) ``index(h)``:
    ``[k, width]`` of the taps-major ``[K, conv_dim]`` or ``[width, k]`` of ``[conv_dim, K]``."""
    if taps_major:
        return pl.BlockSpec((k, width), lambda b, h, t, *_: (0, index(h)))
    return pl.BlockSpec((width, k), lambda b, h, t, *_: (index(h), 0))


def _v_group_specs(bt: int, single_block: bool, km1: int, hk: int, dk: int, r: int,
                   dv: int, taps_major: bool) -> tuple[pl.BlockSpec, pl.BlockSpec, pl.BlockSpec]:
    """BlockSpecs of key-head group h's v channels ``[2 * Hk * dk + h * r * dv, + r * dv)`` in ``mixed
    [B, Tp, conv_dim]`` (``[bt, r * dv]``), the conv weight (taps-major ``[K, conv_dim]`` or ``[conv_dim, K]``)
    and the gathered windows ``[B, K-1, conv_dim]``. ``single_block``: the grid has one token block.

    When the q|k width is a multiple of the group width (r = 1, 2, 4 at dims 128) that is block
    ``2 * Hk * dk / (r * dv) + h`` of a blocked spec. Otherwise (Qwen3.5-27B: 16 key heads, 48 value heads,
    4096 q|k channels, groups of 384) the windows are placed by element offsets, and the offsets' largest
    common power-of-two factor is declared so that Mosaic can prove each DMA lane-aligned (128 at dims 128).
    Slicing v out in XLA instead would copy every v channel of the step through HBM once more (and slices
    of the small operands took the on-chip memory XLA had kept the kernel's output in).
    """
    qk, width = 2 * hk * dk, r * dv
    k = km1 + 1
    if qk % width == 0:
        base = qk // width
        return (pl.BlockSpec((None, bt, width), lambda b, h, t, *_: (b, t, base + h)),
                _weight_spec(k, width, lambda h: base + h, taps_major),
                pl.BlockSpec((None, km1, width), lambda b, h, t, *_: (b, 0, base + h)))
    align = math.gcd(qk, width) & -math.gcd(qk, width)  # largest power of two dividing every offset

    def chan(h):
        return pl.multiple_of(qk + h * width, align)

    def tok(t):  # one token block (decode: T = 1) starts at 0; Mosaic cannot prove ``t * 1`` sublane-aligned
        return 0 if single_block else pl.multiple_of(t * bt, bt)

    el = pl.Element
    return (pl.BlockSpec((None, el(bt), el(width)), lambda b, h, t, *_: (b, tok(t), chan(h))),
            _weight_spec(el(k), el(width), chan, taps_major),
            pl.BlockSpec((None, el(km1), el(width)), lambda b, h, t, *_: (b, 0, chan(h))))


@functools.partial(
    jax.jit, static_argnames=("num_k_heads", "head_k_dim", "head_v_dim", "norm_eps", "block_t",
                              "decode_state_bytes", "chunk_chains", "chunk_size", "recurrent_max_t", "commit",
                              "interpret"),
    donate_argnums=(4, 5))
def fused_gdn(
    mixed: jax.Array,
    conv_weight: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    conv_pool: jax.Array,
    rec_pool: jax.Array,
    layer: jax.Array | int,
    slot_ids: jax.Array,
    new_lens: jax.Array,
    fresh: jax.Array,
    *,
    num_k_heads: int,
    head_k_dim: int,
    head_v_dim: int,
    gate: jax.Array | None = None,
    norm_weight: jax.Array | None = None,
    norm_eps: float = 1e-6,
    block_t: int = 256,
    decode_state_bytes: int | None = None,
    chunk_chains: int = CHUNK_CHAINS,
    chunk_size: int = CHUNK_SIZE,
    recurrent_max_t: int = RECURRENT_MAX_T,
    commit: bool = True,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Conv1d + L2 norm + gated delta rule of a batch, updating the state pools in place (module docstring);
    with ``gate``, also the block's output norm (``delta_rule.gated_rms_norm``, HF ``Qwen3_5MoeRMSNormGated``).

    Args:
        mixed: ``[B, T, conv_dim]`` pre-conv channels, ``conv_dim = 2 * Hk * dk + Hv * dv``; 0 at padding.
        conv_weight: ``[conv_dim, K]`` depthwise kernel.
        g, beta: ``[B, T, Hv]`` float32, 0 at padded tokens.
        conv_pool: ``[L, S * (K-1), conv_dim / 128, 128]`` (kernels/gdn/conv_pool.py), donated.
        rec_pool: ``[L, S, Hv, dk, dv]``, donated.
        layer: GDN-layer index (int32 scalar, may be traced).
        slot_ids: ``[B]`` int32 state slot per row (padding rows use trash slot 0).
        new_lens: ``[B]`` int32 valid tokens per row.
        fresh: ``[B]`` bool, read the row's states as zeros (a sequence's first tokens).
        num_k_heads, head_k_dim, head_v_dim: Hk, dk, dv (Hv comes from ``g``).
        gate: ``[B, T, Hv * dv]`` the ``z`` projection, or None. With it the kernel applies the gated RMSNorm
            per value head in its epilogue and returns it in ``gate.dtype``: the float32 core output never
            reaches HBM (at prefill XLA relaid it out and converted it around a separate norm, ~1 GiB per
            layer at 4096 tokens). A decode step (T == 1) applies the same norm in XLA after the kernel.
        norm_weight: ``[dv]`` the norm's weight (required with ``gate``); norm_eps: its epsilon.
        block_t: tokens per grid step in the chunked form (rounded to a multiple of the chunk).
        decode_state_bytes: in the recurrent form, the most recurrent-state bytes one grid step holds: key heads
            are grouped per step up to it (:func:`decode_heads`). None: ``DECODE_STATE_BYTES`` at T = 1,
            ``SHORT_STATE_BYTES`` at T > 1.
        chunk_chains: in the chunked form, key heads are grouped per grid step (:func:`chunk_heads`) until the
            step holds this many (value head, chunk) pairs: independent chains of products the scheduler can
            overlap.
        chunk_size: tokens a chunk of the chunked form (a power of two; ``CHUNK_SIZE`` = 64, FLA's for these
            models). A dependent 128 x 128 product takes the v5e about as long as a 64 x 64 one
            (bench/mxu_chain.py), so 128 halves the chunks a row's state passes through; a benchmark variant
            until the chip has timed it, and its bf16 error is larger (tests/test_kernels_gdn.py).
        recurrent_max_t: ``T <= recurrent_max_t`` runs the recurrent form (token by token, each token a decode
            step's arithmetic; one grid step per row and key-head group), a longer T the chunked form.
        commit: False: the pools are read, not written (a speculative verify step): the kernel has no state
            output (the state lives in a VMEM scratch, or in registers in the recurrent form), the conv windows
            are not scattered back, and both pools come back as they came in.
        interpret: run in Pallas TPU interpret mode (``pltpu.InterpretParams()``), for CPU.

    Returns:
        ``(o [B, T, Hv, dv], conv_pool, rec_pool)``: ``o`` float32, or normed in ``gate.dtype`` with ``gate``
        (in the kernel's epilogue in the chunked form, by XLA after the kernel in the recurrent form).

    Raises:
        ValueError: when Hv is not a multiple of Hk, ``conv_dim`` does not match the head layout, ``gate``
            comes without ``norm_weight``, or ``chunk_size`` is not a power of two of at least 8.
    """
    bsz, t, conv_dim = mixed.shape
    hv = g.shape[-1]
    hk, dk, dv = num_k_heads, head_k_dim, head_v_dim
    if hv % hk or conv_dim != 2 * hk * dk + hv * dv:
        raise ValueError(f"bad GDN dims: Hk={hk} Hv={hv} dk={dk} dv={dv} conv_dim={conv_dim}")
    r = hv // hk
    if gate is not None and norm_weight is None:
        raise ValueError("a fused output norm needs norm_weight")
    if chunk_size < 8 or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size must be a power of two of at least 8, got {chunk_size}")
    km1 = conv_weight.shape[1] - 1
    heads = 1
    recurrent = t <= recurrent_max_t
    if recurrent:  # one token block of all T tokens (a block dim equal to the array's: any T tiles)
        bt, tp = t, t
        budget = decode_state_bytes
        if budget is None:
            budget = DECODE_STATE_BYTES if t == 1 else SHORT_STATE_BYTES
        heads = decode_heads(hk, r, dk, dv, rec_pool.dtype.itemsize, budget)
    else:
        bt = min(-(-block_t // chunk_size), -(-t // chunk_size)) * chunk_size
        tp = -(-t // bt) * bt
        heads = chunk_heads(hk, r, bt // chunk_size, chunk_chains)
    if tp != t:
        mixed = jnp.pad(mixed, ((0, 0), (0, tp - t), (0, 0)))
        g = jnp.pad(g, ((0, 0), (0, tp - t), (0, 0)))
        beta = jnp.pad(beta, ((0, 0), (0, tp - t), (0, 0)))
        gate = None if gate is None else jnp.pad(gate, ((0, 0), (0, tp - t), (0, 0)))

    # A grid step's group of key heads acts as one key head of width heads * dk with heads * r value heads:
    # the channels, states and g/beta of consecutive key heads are contiguous.
    hk, dk, r = hk // heads, heads * dk, heads * r
    layer_arr = jnp.reshape(jnp.asarray(layer, jnp.int32), (1,))
    slot_ids = slot_ids.astype(jnp.int32)

    def by_group(a: jax.Array) -> jax.Array:  # [B, Tp, Hv] -> [B, Hk, Tp, r]
        return a.astype(jnp.float32).reshape(bsz, tp, hk, r).transpose(0, 2, 1, 3)

    # The conv windows enter as [B, K-1, conv_dim], the rows of the batch's slots, gathered by one DMA per row
    # (kernels/gdn/window_copy.py; XLA's gather ran at ~170 GB/s on the v5e): a Mosaic operand of the whole
    # pool here would make XLA copy it around the call. The gather/scatter moves B x K-1 x conv_dim.
    conv_rows = gather_windows_dma(conv_pool, layer, slot_ids, km1, interpret=interpret)
    # In the recurrent form the taps enter as [K, conv_dim] float32, channels on lanes like the inputs: XLA
    # transposes the small weight once a call, where in the kernel every grid step unpacked and transposed its
    # block on the XLU (~480 of a 4-token step's ~5,000 bundles at the 35B layout; the same values, so the
    # same products). The chunked form keeps the transpose in the kernel: its 256-token conv scheduled ~430
    # bundles longer with the taps-major block (more spills), deviceless v5e, 397B layout.
    conv_taps = conv_weight.astype(jnp.float32).T if recurrent else conv_weight

    norm = None
    norm_in_specs, norm_args = [], []
    out_dtype = jnp.float32
    # A decode step leaves the norm to XLA (below): in the kernel its epilogue lengthened each grid step past
    # what the state copies hide (v5e, 35B layout: 519 -> 578 us at 64 rows, 1,897 -> 2,100 us at 256), where
    # XLA's norm of the step's [B, Hv * dv] output reads a few MiB. The recurrent form's short steps do the same,
    # so that a verify token's output is normed exactly as a decode step's.
    if gate is not None and not recurrent:
        out_dtype = gate.dtype
        # The reference multiplies weight and normed output in their promoted dtype, then the gate in f32.
        norm = (float(norm_eps), jnp.promote_types(norm_weight.dtype, out_dtype) != jnp.float32)
        norm_in_specs = [pl.BlockSpec((None, bt, r * dv), lambda b, h, t, *_: (b, t, h)),
                         pl.BlockSpec((1, dv), lambda b, h, t, *_: (0, 0))]
        norm_args = [gate, norm_weight.reshape(1, dv)]
    kernel = functools.partial(_kernel, dk=dk // heads, dv=dv, r=r // heads, heads=heads, chunk=chunk_size,
                               norm=norm, recurrent=recurrent, commit=commit,
                               bf16=jnp.dtype(mixed.dtype).itemsize < 4)
    state_spec = pl.BlockSpec((None, None, r, head_k_dim, dv),
                              lambda b, h, t, lay, slot, *_: (lay[0], slot[b], h, 0, 0))
    gb_spec = pl.BlockSpec((None, None, bt, r), lambda b, h, t, *_: (b, h, t, 0))
    v_mixed_spec, v_weight_spec, v_window_spec = _v_group_specs(bt, tp == bt, km1, hk, dk, r, dv, recurrent)
    win_in_specs = [pl.BlockSpec((None, km1, dk), lambda b, h, t, *_: (b, 0, h)),
                    pl.BlockSpec((None, km1, dk), lambda b, h, t, *_: (b, 0, hk + h)), v_window_spec]
    win_out_specs = [pl.BlockSpec((None, km1, dk), lambda b, h, t, *_: (b, 0, h)),
                     pl.BlockSpec((None, km1, dk), lambda b, h, t, *_: (b, 0, h)),
                     pl.BlockSpec((None, km1, r * dv), lambda b, h, t, *_: (b, 0, h))]
    # Without commit the state is read through its input block only; the chunked form carries it in a scratch
    # buffer of the pool's dtype (the same roundings as the in-place output block), the recurrent form in registers.
    state_out = ([state_spec], [jax.ShapeDtypeStruct(rec_pool.shape, rec_pool.dtype)]) if commit else ([], [])
    state_scratch = [] if commit or recurrent else [pltpu.VMEM((r, head_k_dim, dv), rec_pool.dtype)]
    # The chunked form's state-independent results per (chunk, value head): U, W, Q and K decayed, the intra-chunk
    # scores and the chunk's decay (one (8, 128) tile); ~160 KiB per pair at dims 128.
    nc, c = bt // chunk_size, chunk_size
    chunk_scratch = [] if recurrent else [pltpu.VMEM((nc, r, c, d), jnp.float32)
                                         for d in (dv, head_k_dim, head_k_dim, head_k_dim, c)] + [
                                             pltpu.VMEM((nc, r, 8, 128), jnp.float32)]
    call = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,
            grid=(bsz, hk, tp // bt),
            in_specs=[
                pl.BlockSpec((None, bt, dk), lambda b, h, t, *_: (b, t, h)),
                pl.BlockSpec((None, bt, dk), lambda b, h, t, *_: (b, t, hk + h)),
                v_mixed_spec,
                _weight_spec(km1 + 1, dk, lambda h: h, recurrent),
                _weight_spec(km1 + 1, dk, lambda h: hk + h, recurrent),
                v_weight_spec,
                gb_spec, gb_spec, *win_in_specs, state_spec, *norm_in_specs,
            ],
            out_specs=[pl.BlockSpec((None, bt, r * dv), lambda b, h, t, *_: (b, t, h)), *win_out_specs,
                       *state_out[0]],
            scratch_shapes=[
                pltpu.VMEM((km1 + bt, dk), jnp.float32),
                pltpu.VMEM((km1 + bt, dk), jnp.float32),
                pltpu.VMEM((km1 + bt, r * dv), jnp.float32),
                pltpu.VMEM((bt, dk), jnp.float32),
                pltpu.VMEM((bt, dk), jnp.float32),
                pltpu.VMEM((bt, r * dv), jnp.float32),
                pltpu.VMEM((bt, r * dv), jnp.float32),
                *chunk_scratch,
                *state_scratch,
            ],
        ),
        out_shape=[jax.ShapeDtypeStruct((bsz, tp, hv * dv), out_dtype),
                   jax.ShapeDtypeStruct((bsz, km1, hk * dk), conv_pool.dtype),
                   jax.ShapeDtypeStruct((bsz, km1, hk * dk), conv_pool.dtype),
                   jax.ShapeDtypeStruct((bsz, km1, hv * dv), conv_pool.dtype), *state_out[1]],
        # Operand indices count the 4 scalar-prefetch operands: rec_pool is operand 15.
        input_output_aliases={15: 4} if commit else {},
        # The chunked form's 16 chunk chains a step spill past the 16 MiB of scoped VMEM Mosaic allows by default
        # (16 pairs at 32 x 64: 16.04 MiB, deviceless v5e): it gets 48 MiB (the v5e has 128, Ironwood 64).
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary"),
            vmem_limit_bytes=None if recurrent else 48 << 20),
        interpret=pltpu.InterpretParams() if interpret else False,
        # XLA cannot see in: the traffic is the rows' inputs and outputs and each row's recurrent state
        # read once and (with commit) written once (not the whole pool operand).
        cost_estimate=pl.CostEstimate(
            flops=int(bsz * tp * hv * head_k_dim * dv * 6), transcendentals=int(bsz * tp * hv * 2),
            bytes_accessed=int(bsz * tp * (conv_dim * mixed.dtype.itemsize + 8 * hv
                                           + hv * dv * jnp.dtype(out_dtype).itemsize * (2 if norm else 1))
                               + 3 * bsz * km1 * conv_dim * conv_pool.dtype.itemsize
                               + (2 if commit else 1) * bsz * hv * head_k_dim * dv * rec_pool.dtype.itemsize)),
    )
    # The planner finds each form by its scope (tools/plan/programs.py) and charges it the chip's rate for it.
    with jax.named_scope(RECURRENT_SCOPE if recurrent else CHUNKED_SCOPE):
        o, cq, ck, cv, *rec_out = call(
            layer_arr, slot_ids, new_lens.astype(jnp.int32), fresh.astype(jnp.int32), mixed, mixed, mixed,
            conv_taps, conv_taps, conv_taps, by_group(g), by_group(beta), conv_rows, conv_rows, conv_rows, rec_pool,
            *norm_args,
        )
    if commit:
        conv_pool = scatter_windows_dma(conv_pool, layer, slot_ids, jnp.concatenate([cq, ck, cv], axis=-1),
                                        interpret=interpret)
        (rec_pool,) = rec_out
    o = o.reshape(bsz, tp, hv, dv)[:, :t]
    if gate is not None and norm is None:  # the recurrent form: the reference's own norm
        o = gated_rms_norm(o.astype(gate.dtype), gate.reshape(o.shape), norm_weight, norm_eps)
    return o, conv_pool, rec_pool
