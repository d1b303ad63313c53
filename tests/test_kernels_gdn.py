"""Fused conv1d + Gated DeltaNet: the Pallas kernel in interpret mode (CPU) against the model's jnp reference.

Seeded ragged batches over state pools: only decodes (recurrent form), only prefills (chunked form, several
64-token chunks and token blocks), mixed lengths, fresh sequences (states read as zeros), padding rows on
the trash slot, slots out of order; and every head layout kind (value heads per key head 1-4, dk != dv, the
element-offset v groups of Qwen3.5-27B's ratio). Tolerances (max abs error, values O(1)): fp32 state 1e-4 on outputs and
states (both sides compute in fp32; the kernel inverts the chunk system by matmuls, the reference by a
triangular solve). The bf16-state option is compared against the fp32 state over a prefill followed by
decode steps and its error is printed and bounded.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import record

from sglang_tpu_qwen.kernels.gdn import conv_pool
from sglang_tpu_qwen.kernels.gdn.kernel import CHUNK_CHAINS, chunk_heads, fused_gdn
from sglang_tpu_qwen.kernels.gdn.reference import fused_gdn_reference

HK, HV, DK, DV, K = 2, 4, 32, 32, 4
CONV_DIM = 2 * HK * DK + HV * DV
DIMS = dict(num_k_heads=HK, head_k_dim=DK, head_v_dim=DV)
TOL = 1e-4


def _pools(rng, layers=2, slots=8, dtype=jnp.float32, heads=(HK, HV, DK, DV)):
    hk, hv, dk, dv = heads
    conv = jnp.asarray(rng.standard_normal(conv_pool.pool_shape(layers, slots, 2 * hk * dk + hv * dv, K - 1)), dtype)
    rec = jnp.asarray(rng.standard_normal((layers, slots, hv, dk, dv)) * 0.1, dtype)
    return conv, rec


def _step(rng, lens, t, heads=(HK, HV, DK, DV)):
    """Inputs of one step: pre-conv channels, log-decay and write strength, zero at padded tokens."""
    hk, hv, dk, dv = heads
    lens = np.asarray(lens, np.int32)
    valid = (np.arange(t)[None, :] < lens[:, None])[..., None]
    mixed = jnp.asarray(rng.standard_normal((len(lens), t, 2 * hk * dk + hv * dv)) * valid, jnp.float32)
    g = jnp.asarray(-rng.uniform(0.0, 0.5, (len(lens), t, hv)) * valid, jnp.float32)
    beta = jnp.asarray(rng.uniform(0.0, 1.0, (len(lens), t, hv)) * valid, jnp.float32)
    return mixed, g, beta, jnp.asarray(lens)


def _run_both(rng, lens, t, slots, fresh, layer=1, block_t=64, heads=(HK, HV, DK, DV), **kernel_kw):
    hk, hv, dk, dv = heads
    dims = dict(num_k_heads=hk, head_k_dim=dk, head_v_dim=dv)
    conv_w = jnp.asarray(rng.standard_normal((2 * hk * dk + hv * dv, K)) * 0.5, jnp.float32)
    conv, rec = _pools(rng, heads=heads)
    mixed, g, beta, lens = _step(rng, lens, t, heads)
    slots, fresh = jnp.asarray(slots, jnp.int32), jnp.asarray(fresh, bool)
    ref = fused_gdn_reference(mixed, conv_w, g, beta, conv, rec, layer, slots, lens, fresh, **dims)
    ker = fused_gdn(mixed, conv_w, g, beta, jnp.array(conv, copy=True), jnp.array(rec, copy=True), layer, slots,
                    lens, fresh, block_t=block_t, interpret=True, **dims, **kernel_kw)
    valid = np.arange(t)[None, :] < np.asarray(lens)[:, None]
    return ref, ker, valid, (conv, rec)


def _assert_close(ref, ker, valid, before):
    o_r, conv_r, rec_r = (np.asarray(x) for x in ref)
    o_k, conv_k, rec_k = (np.asarray(x) for x in ker)
    assert np.all(np.isfinite(o_k))
    assert np.abs(o_k - o_r)[valid].max() <= TOL
    # Slot 0 is the trash slot (padding rows); every other slot must match, untouched ones exactly.
    assert np.abs(conv_k[:, K - 1 :] - conv_r[:, K - 1 :]).max() <= TOL  # slot 0's K-1 rows
    assert np.abs(rec_k[:, 1:] - rec_r[:, 1:]).max() <= TOL
    np.testing.assert_array_equal(rec_k[0], np.asarray(before[1])[0])  # other layer untouched


def test_only_decodes_recurrent_form() -> None:
    rng = np.random.default_rng(10)
    # Slots out of order; one fresh sequence; one padding row on trash slot 0.
    ref, ker, valid, before = _run_both(rng, [1, 1, 1, 0], 1, slots=[5, 2, 7, 0], fresh=[False, True, False, False])
    _assert_close(ref, ker, valid, before)


def test_only_prefills_chunked_form() -> None:
    rng = np.random.default_rng(11)
    # 150 tokens = 3 token blocks of 64 (the last partial), several chunks; one continues a cached prefix.
    ref, ker, valid, before = _run_both(rng, [150, 129], 150, slots=[3, 6], fresh=[True, False])
    _assert_close(ref, ker, valid, before)


def test_mixed_lengths_one_block() -> None:
    rng = np.random.default_rng(12)
    ref, ker, valid, before = _run_both(rng, [1, 64, 37, 0], 64, slots=[4, 1, 6, 0],
                                        fresh=[False, True, False, False], block_t=256)
    _assert_close(ref, ker, valid, before)


# Head layouts (Hk, Hv, dk, dv): value heads per key head 1, 2 (with dv != dk; the tests above run r = 2 at
# dk = dv), 3, 4, and dk != dv both ways. Where the q|k
# width 2 * Hk * dk is not a multiple of the group width r * dv (r = 3 here, and dv 48 > dk) the kernel places
# the v block by element offset (kernel._v_group_spec); the others take the blocked spec. The last case is
# Qwen3.5-27B's ratio at the released dims 128 (one key head).
LAYOUTS = {
    "r1": (2, 2, 32, 32), "r3": (2, 6, 32, 32), "r4": (2, 8, 32, 32),
    "r2-dv48": (2, 4, 32, 48), "r3-dk48-dv16": (2, 6, 48, 16), "r3-d128": (1, 3, 128, 128),
}


@pytest.mark.parametrize("heads", LAYOUTS.values(), ids=LAYOUTS.keys())
@pytest.mark.parametrize(("lens", "t", "slots", "fresh"),
                         [([1, 1, 0], 1, [5, 2, 0], [False, True, False]), ([130, 70], 130, [3, 6], [False, True])],
                         ids=["decode", "prefill"])
def test_head_layouts(heads, lens, t, slots, fresh) -> None:
    """Every head layout, decode (recurrent form) and chunked prefill (3 token blocks of 64, one row
    continuing a cached state), against the reference: outputs, conv windows and recurrent states."""
    rng = np.random.default_rng(20)
    ref, ker, valid, before = _run_both(rng, lens, t, slots, fresh, heads=heads)
    assert ker[0].shape == ref[0].shape == (len(lens), t, heads[1], heads[3])
    _assert_close(ref, ker, valid, before)


@pytest.mark.parametrize(("heads", "budget", "per_step"), [
    ((4, 8, 32, 32), 1, 1), ((4, 8, 32, 32), 16 << 10, 2), ((4, 8, 32, 32), 1 << 20, 4),
    ((4, 12, 32, 32), 24 << 10, 2),  # 2 key heads of r = 3: v groups placed by element offset
], ids=["1-head", "2-heads", "all-heads", "r3-2-heads"])
def test_decode_groups_key_heads_per_step(heads, budget, per_step) -> None:
    """Decode steps group key heads up to ``decode_state_bytes`` of state (kernel.decode_heads): every
    grouping gives the reference's outputs and states."""
    from sglang_tpu_qwen.kernels.gdn.kernel import decode_heads

    hk, hv, dk, dv = heads
    assert decode_heads(hk, hv // hk, dk, dv, 4, budget) == per_step
    rng = np.random.default_rng(21)
    ref, ker, valid, before = _run_both(rng, [1, 1, 1, 0], 1, [5, 2, 7, 0], [False, True, False, False],
                                        heads=heads, decode_state_bytes=budget)
    _assert_close(ref, ker, valid, before)


def test_steps_chain_through_the_pools() -> None:
    """Prefill then decodes through the kernel alone equal the reference chain (state carried in the pools)."""
    rng = np.random.default_rng(13)
    conv_w = jnp.asarray(rng.standard_normal((CONV_DIM, K)) * 0.5, jnp.float32)
    pools_r = _pools(rng)
    pools_k = tuple(jnp.array(p, copy=True) for p in pools_r)
    slots = jnp.asarray([2, 5], jnp.int32)
    for step, (lens, t) in enumerate([([70, 5], 70), ([1, 1], 1)]):
        mixed, g, beta, lens = _step(rng, lens, t)
        fresh = jnp.asarray([step == 0] * 2)
        o_r, *pools_r = fused_gdn_reference(mixed, conv_w, g, beta, *pools_r, 0, slots, lens, fresh, **DIMS)
        o_k, *pools_k = fused_gdn(mixed, conv_w, g, beta, *pools_k, 0, slots, lens, fresh, block_t=64,
                                  interpret=True, **DIMS)
        valid = np.arange(t)[None, :] < np.asarray(lens)[:, None]
        assert np.abs(np.asarray(o_k) - np.asarray(o_r))[valid].max() <= TOL, f"step {step}"
    for a, b in zip(pools_k, pools_r, strict=True):
        first = K - 1 if a.ndim == 3 else 1  # past slot 0: the conv pool's first K-1 rows, the rec pool's slot
        assert np.abs(np.asarray(a)[:, first:] - np.asarray(b)[:, first:]).max() <= TOL


def test_chunks_of_128_tokens_match_reference() -> None:
    """The ``chunk_size=128`` variant over two token blocks of 256 (the second partial), a row ending inside a
    chunk, a fresh row and a padding row: within the float32 tolerance of the reference (which chunks by 64)."""
    rng = np.random.default_rng(19)
    ref, ker, valid, before = _run_both(rng, [300, 129, 0], 300, [4, 2, 0], [False, True, False], block_t=256,
                                        chunk_size=128)
    _assert_close(ref, ker, valid, before)


def test_chunk_chains_per_step_change_nothing() -> None:
    """Grouping more (chunk, value head) pairs a grid step only reorders independent work: one key head a step
    (8 pairs: four 64-token chunks of its 2 value heads) and both (16 pairs, the default ``CHUNK_CHAINS``) give
    the same outputs and pools bit for bit."""
    rng = np.random.default_rng(17)
    conv_w = jnp.asarray(rng.standard_normal((CONV_DIM, K)) * 0.5, jnp.float32)
    conv, rec = _pools(rng)
    mixed, g, beta, lens = _step(rng, [256, 90, 0], 256)
    slots, fresh = jnp.asarray([3, 6, 0], jnp.int32), jnp.asarray([False, True, False])
    assert [chunk_heads(HK, HV // HK, 4, c) for c in (1, CHUNK_CHAINS)] == [1, 2]
    runs = [fused_gdn(mixed, conv_w, g, beta, jnp.array(conv, copy=True), jnp.array(rec, copy=True), 1, slots, lens,
                      fresh, block_t=256, chunk_chains=chains, interpret=True, **DIMS) for chains in (1, CHUNK_CHAINS)]
    for run in runs[1:]:
        for a, b in zip(run, runs[0], strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("state_dtype", [jnp.bfloat16])
def test_bf16_state_error_against_fp32(state_dtype) -> None:
    """bf16 recurrent/conv state: error of the outputs against the fp32-state kernel over prefill + decodes."""
    rng = np.random.default_rng(14)
    conv_w = jnp.asarray(rng.standard_normal((CONV_DIM, K)) * 0.5, jnp.float32)
    conv, rec = _pools(rng)
    p32 = (conv, rec)
    p16 = (conv.astype(state_dtype), rec.astype(state_dtype))
    slots = jnp.asarray([1, 3], jnp.int32)
    worst, scale = 0.0, 0.0
    for step, (lens, t) in enumerate([([100, 90], 100)] + [([1, 1], 1)] * 3):
        mixed, g, beta, lens = _step(rng, lens, t)
        fresh = jnp.asarray([step == 0] * 2)
        o32, *p32 = fused_gdn(mixed, conv_w, g, beta, *p32, 0, slots, lens, fresh, interpret=True, **DIMS)
        o16, *p16 = fused_gdn(mixed, conv_w, g, beta, *p16, 0, slots, lens, fresh, interpret=True, **DIMS)
        valid = np.arange(t)[None, :] < np.asarray(lens)[:, None]
        worst = max(worst, float(np.abs(np.asarray(o16) - np.asarray(o32))[valid].max()))
        scale = max(scale, float(np.abs(np.asarray(o32))[valid].max()))
    assert p16[1].dtype == state_dtype
    record("Fused GDN kernel: bf16 recurrent state vs fp32",
           f"max abs output error {worst:.2e} (outputs up to {scale:.2f}), relative {worst / scale:.2e}")
    assert 0 < worst <= 2e-2 * scale  # bf16 keeps ~3 significant digits; the error must stay at that level


def test_bf16_model_prefill_single_pass_mxu() -> None:
    """A bf16 model's chunked prefill (``mixed`` in bf16) runs its MXU products in one bf16 pass (FLA's choice),
    the cumulative log-decay exact: against the float32 reference on the same input values, the outputs and
    the state stay at bf16 rounding level (measured ~3-4e-3 relative rms at dims 128 over 512 tokens), and
    float32 inputs keep the six-pass products (errors ~1e-7)."""
    rng = np.random.default_rng(17)
    mixed, g, beta, lens = _step(rng, [150, 129], 150)
    mixed = jnp.asarray(mixed, jnp.bfloat16).astype(jnp.float32)  # the same values on both paths
    conv_w = jnp.asarray(jnp.asarray(rng.standard_normal((CONV_DIM, K)) * 0.5, jnp.bfloat16), jnp.float32)
    conv, rec = _pools(rng)
    slots, fresh = jnp.asarray([3, 6], jnp.int32), jnp.asarray([True, False])
    o_r, _, rec_r = fused_gdn_reference(mixed, conv_w, g, beta, conv, rec, 1, slots, lens, fresh, **DIMS)
    valid = np.arange(150)[None, :] < np.asarray(lens)[:, None]
    errors = {}
    for dtype in (jnp.float32, jnp.bfloat16):
        o_k, _, rec_k = fused_gdn(mixed.astype(dtype), conv_w, g, beta, jnp.array(conv, copy=True),
                                  jnp.array(rec, copy=True), 1, slots, lens, fresh, block_t=64, interpret=True,
                                  **DIMS)
        o_d, s_d = np.asarray(o_k - o_r)[valid], np.asarray(rec_k - rec_r)[1, 1:]
        errors[dtype] = (np.sqrt(np.mean(o_d**2) / np.mean(np.asarray(o_r)[valid] ** 2)),
                         np.sqrt(np.mean(s_d**2) / np.mean(np.asarray(rec_r)[1, 1:] ** 2)))
    record("Fused GDN kernel: bf16 model's single-pass MXU prefill vs float32 reference",
           f"relative rms error output {errors[jnp.bfloat16][0]:.1e}, state {errors[jnp.bfloat16][1]:.1e} "
           f"(float32 inputs: {errors[jnp.float32][0]:.1e}, {errors[jnp.float32][1]:.1e})")
    assert max(errors[jnp.float32]) < 1e-5
    assert 1e-4 < max(errors[jnp.bfloat16]) < 1e-2


def test_rejects_bad_dims() -> None:
    rng = np.random.default_rng(15)
    conv, rec = _pools(rng)
    mixed, g, beta, lens = _step(rng, [1], 1)
    with pytest.raises(ValueError, match="bad GDN dims"):
        fused_gdn(mixed, jnp.zeros((CONV_DIM, K)), g, beta, conv, rec, 0, jnp.zeros(1, jnp.int32), lens,
                  jnp.zeros(1, bool), num_k_heads=HK, head_k_dim=DK + 1, head_v_dim=DV, interpret=True)
    with pytest.raises(ValueError, match="chunk_size"):
        fused_gdn(mixed, jnp.zeros((CONV_DIM, K)), g, beta, conv, rec, 0, jnp.zeros(1, jnp.int32), lens,
                  jnp.zeros(1, bool), chunk_size=96, interpret=True, **DIMS)


@pytest.mark.parametrize(("gate_dtype", "weight_dtype"), [(jnp.bfloat16, jnp.bfloat16), (jnp.bfloat16, jnp.float32),
                                                          (jnp.float32, jnp.float32)])
@pytest.mark.parametrize(("lens", "t"), [([1, 1, 0], 1), ([150, 70], 150)], ids=["decode", "prefill"])
def test_fused_output_norm_matches_reference(gate_dtype, weight_dtype, lens, t) -> None:
    """With ``gate`` the kernel returns the gated RMSNorm of its output (the model's ``gated_rms_norm``) in
    the gate's dtype: within one rounding of that dtype of the reference (the float32 outputs before the
    norm differ by up to TOL, which can move a value across a bf16 rounding boundary). Prefill fuses the norm
    into the kernel's epilogue, op for op; a decode step leaves it to XLA, which may keep the norm's bf16
    intermediates in float32 where its fusions allow (xla_allow_excess_precision), so fewer values agree
    bit for bit there."""
    rng = np.random.default_rng(16)
    conv_w = jnp.asarray(rng.standard_normal((CONV_DIM, K)) * 0.5, jnp.float32)
    conv, rec = _pools(rng)
    mixed, g, beta, lens = _step(rng, lens, t)
    slots = jnp.asarray([3, 6, 0][: len(lens)], jnp.int32)
    fresh = jnp.zeros(len(lens), bool)
    gate = jnp.asarray(rng.standard_normal((len(lens), t, HV * DV)) * 2, gate_dtype)
    weight = jnp.asarray(1 + rng.standard_normal(DV) * 0.3, weight_dtype)
    norm = dict(gate=gate, norm_weight=weight, norm_eps=1e-6)
    o_r, *_ = fused_gdn_reference(mixed, conv_w, g, beta, conv, rec, 1, slots, lens, fresh, **norm, **DIMS)
    o_k, *_ = fused_gdn(mixed, conv_w, g, beta, jnp.array(conv, copy=True), jnp.array(rec, copy=True), 1, slots,
                        lens, fresh, block_t=64, interpret=True, **norm, **DIMS)
    assert o_k.dtype == o_r.dtype == gate_dtype and o_k.shape == o_r.shape == (len(lens), t, HV, DV)
    valid = np.arange(t)[None, :] < np.asarray(lens)[:, None]
    o_r, o_k = np.asarray(o_r, np.float32)[valid], np.asarray(o_k, np.float32)[valid]
    ulp = 2.0**-7 if gate_dtype == jnp.bfloat16 else 1e-5
    assert np.abs(o_k - o_r).max() <= ulp * np.abs(o_r).max()
    # Most values agree exactly in bf16 where the kernel's epilogue applies the norm, op for op.
    assert np.mean(o_k == o_r) >= (0.99 if gate_dtype == jnp.bfloat16 and t > 1 else 0.0)
    with pytest.raises(ValueError, match="norm_weight"):
        fused_gdn(mixed, conv_w, g, beta, conv, rec, 1, slots, lens, fresh, gate=gate, interpret=True, **DIMS)


# ---- the recurrent form of short steps (a speculative verify's k + 1 tokens) and the no-commit mode ----------


@pytest.mark.parametrize(("lens", "t", "budget"), [([4, 2, 0, 4], 4, 1), ([3, 1, 0], 3, 1 << 20), ([8, 5], 8, 1)],
                         ids=["T4", "T3-grouped-heads", "T8"])
def test_short_steps_recurrent_form(lens, t, budget) -> None:
    """T <= RECURRENT_MAX_T runs token by token (one token block of all T): against the reference, with a
    fresh row, a padding row on the trash slot, ragged lengths and key heads grouped per step or not."""
    rng = np.random.default_rng(30 + t)
    slots = [5, 2, 0, 7][: len(lens)] if 0 in lens else [5, 2]
    fresh = [False, True, False, False][: len(lens)]
    ref, ker, valid, before = _run_both(rng, lens, t, slots, fresh, decode_state_bytes=budget)
    _assert_close(ref, ker, valid, before)


@pytest.mark.parametrize("state_dtype", [jnp.float32, jnp.bfloat16])
def test_short_step_equals_decode_steps(state_dtype) -> None:
    """A 4-token call gives each token what four decode calls give (outputs, both pools), a bf16 state included
    (rounded after every token, as each decode step rounds it on store): a verify step runs a plain decode step's
    arithmetic per token. Interpreted on XLA:CPU the two programs are fused differently (a multiply-add may be
    contracted in one and not the other), so values may differ in the last bit (1e-6 here; the conv windows,
    copies of inputs, exactly); tests/tpu/test_kernels_on_chip.py asks for bit equality of Mosaic's programs."""
    rng = np.random.default_rng(31)
    conv_w = jnp.asarray(rng.standard_normal((CONV_DIM, K)) * 0.5, jnp.float32)
    pools = tuple(p.astype(state_dtype) for p in _pools(rng))
    mixed, g, beta, lens = _step(rng, [4, 4, 4], 4)
    slots, fresh = jnp.asarray([3, 6, 1], jnp.int32), jnp.asarray([False, True, False])
    o4, *p4 = fused_gdn(mixed, conv_w, g, beta, *(jnp.array(p, copy=True) for p in pools), 1, slots, lens, fresh,
                        interpret=True, **DIMS)
    p1 = [jnp.array(p, copy=True) for p in pools]
    bf16 = state_dtype == jnp.bfloat16
    for i in range(4):
        o1, *p1 = fused_gdn(mixed[:, i : i + 1], conv_w, g[:, i : i + 1], beta[:, i : i + 1], *p1, 1, slots,
                            jnp.ones(3, jnp.int32), fresh & (i == 0), interpret=True, **DIMS)
        # bf16: where a last-bit difference moved a state entry across a rounding boundary, the outputs
        # after it differ by about one bf16 rounding of that entry times q.
        assert np.abs(np.asarray(o4[:, i]) - np.asarray(o1[:, 0])).max() <= (1e-3 if bf16 else 1e-6)
    np.testing.assert_array_equal(np.asarray(p4[0]), np.asarray(p1[0]))
    want = np.asarray(p1[1], np.float32)
    diff = np.abs(np.asarray(p4[1], np.float32) - want)
    # bf16: a rounding step of the largest entries (a flipped rounding also moves later tokens' updates).
    assert diff.max() <= (2.0**-7 * np.abs(want).max() if bf16 else 1e-6)
    np.testing.assert_array_equal(diff[0], 0)  # the other layer untouched
    # float32: most of the rows' state entries agree bit for bit. (bf16: a last-bit difference that crosses a
    # rounding boundary spreads through the later tokens' updates, so the interpreted programs cannot tell a
    # state rounded between tokens from one carried in float32 this way; the chip test compares bits.)
    if not bf16:
        assert np.mean(diff[1, np.asarray(slots)] == 0) >= 0.5


@pytest.mark.parametrize(("lens", "t", "state_dtype"),
                         [([4, 2, 0], 4, jnp.float32), ([4, 2, 0], 4, jnp.bfloat16), ([70, 9, 0], 70, jnp.float32)],
                         ids=["recurrent", "recurrent-bf16-state", "chunked"])
def test_no_commit_reads_the_pools_only(lens, t, state_dtype) -> None:
    """``commit=False`` (a verify step): the outputs of the committing call, and both pools exactly as they were,
    the trash slot included; the reference's option likewise. Rows: a short one, a fresh one, a padding one (0
    tokens). The recurrent form's verify carries each head's state in registers where the committing call
    stores it between tokens, rounded to the pool's dtype as that store rounds it (a bf16 state: a missed
    rounding moves outputs by ~1e-3): the same arithmetic, which the chip runs bit for bit (tests/tpu), but
    XLA:CPU fuses the two interpreted programs differently (last-bit differences), so here the outputs agree
    within 1e-6."""
    rng = np.random.default_rng(32)
    conv_w = jnp.asarray(rng.standard_normal((CONV_DIM, K)) * 0.5, jnp.float32)
    conv, rec = _pools(rng)
    rec = rec.astype(state_dtype)
    mixed, g, beta, lens = _step(rng, lens, t)
    slots, fresh = jnp.asarray([4, 2, 0], jnp.int32), jnp.asarray([False, True, False])
    args = (mixed, conv_w, g, beta)
    o_c, *_ = fused_gdn(*args, jnp.array(conv, copy=True), jnp.array(rec, copy=True), 1, slots, lens, fresh,
                        block_t=64, interpret=True, **DIMS)
    o_v, conv_v, rec_v = fused_gdn(*args, jnp.array(conv, copy=True), jnp.array(rec, copy=True), 1, slots, lens,
                                   fresh, block_t=64, commit=False, interpret=True, **DIMS)
    np.testing.assert_allclose(np.asarray(o_v), np.asarray(o_c), rtol=0, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(conv_v), np.asarray(conv))
    np.testing.assert_array_equal(np.asarray(rec_v), np.asarray(rec))
    o_r, conv_r, rec_r = fused_gdn_reference(*args, conv, rec, 1, slots, lens, fresh, commit=False, **DIMS)
    assert conv_r is conv and rec_r is rec
    valid = np.arange(t)[None, :] < np.asarray(lens)[:, None]
    # The reference carries a bf16 state in float32 between a call's tokens: a bf16 rounding apart.
    tol = TOL if state_dtype == jnp.float32 else 1e-3
    assert np.abs(np.asarray(o_v) - np.asarray(o_r))[valid].max() <= tol


def test_verify_then_commit_accepted_prefix() -> None:
    """The speculative cycle through the kernel: a 4-token verify call without commit, then the commit call
    over the same inputs with ``new_lens = commit_lens`` (4, 2, 1 and 0 accepted; tokens past them zeroed in g
    and beta): each slot holds exactly the state after its accepted tokens (bit for bit what a call over only
    those tokens leaves, within TOL of the reference's), and the commit call's outputs at the accepted tokens
    are the verify call's (within 1e-6 here: last bits, below)."""
    rng = np.random.default_rng(33)
    conv_w = jnp.asarray(rng.standard_normal((CONV_DIM, K)) * 0.5, jnp.float32)
    conv, rec = _pools(rng)
    mixed, g, beta, lens = _step(rng, [4, 4, 4, 4, 0], 4)
    slots, fresh = jnp.asarray([3, 6, 1, 5, 0], jnp.int32), jnp.zeros(5, bool)
    kw = dict(interpret=True, **DIMS)
    o_v, conv_v, rec_v = fused_gdn(mixed, conv_w, g, beta, jnp.array(conv, copy=True), jnp.array(rec, copy=True), 1,
                                   slots, lens, fresh, commit=False, **kw)
    commit_lens = jnp.asarray([4, 2, 1, 0, 0], jnp.int32)
    keep = (np.arange(4)[None, :] < np.asarray(commit_lens)[:, None])[..., None]
    gk, bk = jnp.where(keep, g, 0.0), jnp.where(keep, beta, 0.0)
    o_c, conv_c, rec_c = fused_gdn(mixed, conv_w, gk, bk, conv_v, rec_v, 1, slots, commit_lens, fresh, **kw)
    # The chip gives these bit for bit (tests/tpu); XLA:CPU fuses the verify's interpreted program differently.
    np.testing.assert_allclose(np.asarray(o_c)[keep[..., 0]], np.asarray(o_v)[keep[..., 0]], rtol=0, atol=1e-6)
    # The same rows fed only their accepted tokens (zeros past them).
    o_a, conv_a, rec_a = fused_gdn(jnp.where(keep, mixed, 0.0), conv_w, gk, bk, jnp.array(conv, copy=True),
                                   jnp.array(rec, copy=True), 1, slots, commit_lens, fresh, **kw)
    np.testing.assert_array_equal(np.asarray(conv_c)[:, K - 1 :], np.asarray(conv_a)[:, K - 1 :])
    np.testing.assert_array_equal(np.asarray(rec_c)[:, 1:], np.asarray(rec_a)[:, 1:])
    _, conv_r, rec_r = fused_gdn_reference(mixed, conv_w, gk, bk, jnp.array(conv, copy=True),
                                           jnp.array(rec, copy=True), 1, slots, commit_lens, fresh, **DIMS)
    assert np.abs(np.asarray(rec_c)[:, 1:] - np.asarray(rec_r)[:, 1:]).max() <= TOL
    assert np.abs(np.asarray(conv_c)[:, K - 1 :] - np.asarray(conv_r)[:, K - 1 :]).max() <= TOL


def test_copy_slots_copies_only_snapshot_rows() -> None:
    """kernels/gdn/slot_copy.py: slot dst[b] of every layer becomes slot src[b] where dst[b] != 0; every other
    byte of both pools stays (the trash slot 0 included: rows without a snapshot copy nothing)."""
    from sglang_tpu_qwen.kernels.gdn.slot_copy import copy_slots

    rng = np.random.default_rng(34)
    conv, rec = _pools(rng, layers=3, slots=8)
    src, dst = jnp.asarray([3, 6, 1, 0], jnp.int32), jnp.asarray([5, 0, 7, 0], jnp.int32)
    conv_c, rec_c = copy_slots(jnp.array(conv, copy=True), jnp.array(rec, copy=True), src, dst, taps=K - 1,
                               interpret=True)
    want_rec, want_conv = np.array(rec), np.array(conv)
    for s, d in ((3, 5), (1, 7)):
        want_rec[:, d] = want_rec[:, s]
        want_conv[:, d * (K - 1) : (d + 1) * (K - 1)] = want_conv[:, s * (K - 1) : (s + 1) * (K - 1)]
    np.testing.assert_array_equal(np.asarray(rec_c), want_rec)
    np.testing.assert_array_equal(np.asarray(conv_c), want_conv)


@pytest.mark.parametrize(("dtype", "chunk"), [(jnp.float32, 64), (jnp.bfloat16, 64), (jnp.bfloat16, 128)],
                         ids=["f32", "bf16", "bf16-c128"])
def test_repeated_token_prefill(dtype, chunk: int) -> None:
    """A prompt of one repeated token with write strength 0.99 and no decay (and a second row of near-repeats
    continuing a state): keys alike make every chunk's ``L`` entries near 1, whose powers reach ~1e17 at 64 tokens.
    The kernel's nilpotent-product inverse gave outputs of 1e20 here against the reference's 0.16; the recursive
    block inverse (kernels/gdn/unit_lower_inverse.py) stays within the float32 tolerance, and a bfloat16 model's
    single-pass products at bf16 rounding level (relative rms under 1e-2); so do chunks of 128 tokens (the
    ``chunk_size`` variant: one chunk a row here, its inverse a level deeper)."""
    rng = np.random.default_rng(3)
    t, lens = 128, jnp.asarray([128, 100], jnp.int32)
    mixed = np.broadcast_to(rng.standard_normal(CONV_DIM), (2, t, CONV_DIM)).copy()
    mixed[1] += 0.3 * rng.standard_normal((t, CONV_DIM))
    valid = np.arange(t)[None, :] < np.asarray(lens)[:, None]
    mixed = jnp.asarray(mixed * valid[..., None], jnp.bfloat16).astype(jnp.float32)  # the same values both ways
    g = jnp.asarray(np.where(valid, [[0.0], [-0.01]], 0.0)[..., None].repeat(HV, -1), jnp.float32)
    beta = jnp.asarray(np.where(valid, 0.99, 0.0)[..., None].repeat(HV, -1), jnp.float32)
    conv_w = jnp.asarray(rng.standard_normal((CONV_DIM, K)) * 0.5, jnp.float32)
    conv, rec = _pools(rng)
    slots, fresh = jnp.asarray([3, 6], jnp.int32), jnp.asarray([True, False])
    o_r, _, rec_r = fused_gdn_reference(mixed, conv_w, g, beta, conv, rec, 1, slots, lens, fresh, **DIMS)
    o_k, _, rec_k = fused_gdn(mixed.astype(dtype), conv_w, g, beta, jnp.array(conv, copy=True),
                              jnp.array(rec, copy=True), 1, slots, lens, fresh, block_t=64, chunk_size=chunk,
                              interpret=True, **DIMS)
    o_k, o_r = np.asarray(o_k)[valid], np.asarray(o_r)[valid]
    s_k, s_r = np.asarray(rec_k)[1, [3, 6]], np.asarray(rec_r)[1, [3, 6]]
    if dtype == jnp.float32:
        assert np.abs(o_k - o_r).max() <= TOL and np.abs(s_k - s_r).max() <= TOL
    else:
        rms = max(np.sqrt(np.mean((a - b) ** 2) / np.mean(b**2)) for a, b in ((o_k, o_r), (s_k, s_r)))
        record(f"Fused GDN kernel: bf16 model's prefill of a repeated token vs float32 reference, chunk {chunk}",
               f"relative rms error {rms:.1e}")
        assert rms < 1e-2


def test_lane_replicated_columns_are_the_float32_values():
    """The recurrent form's MXU broadcast (kernel._split_columns / _lane_replicated): each value's three bfloat16
    parts, cut toward zero, sum back to it in every order (so no accumulation order of the MXU can round), and
    the product with the selector gives every column's values on every lane, bit for bit (-0.0 as +0.0). The
    values include 2 - 16449 * 2^-23, whose parts rounded to nearest sum to another float32 when the high and low
    parts are added first."""
    import itertools

    from sglang_tpu_qwen.kernels.gdn.kernel import _bf16_toward_zero, _lane_replicated, _split_columns

    rng = np.random.default_rng(0)
    tricky = np.float32(2) - np.float32(16449) * np.float32(2.0**-23)
    values = np.concatenate([rng.standard_normal(1000) * scale for scale in (1.0, 1e-3, 1e3, 1e-25, 1e25)]
                            + [[tricky, -tricky, 1.0, -1.0, 2.0**-100, 3e38, -3e38]]).astype(np.float32)
    x = jnp.asarray(values)
    hi = _bf16_toward_zero(x)
    mid = _bf16_toward_zero(x - hi)
    parts = [np.asarray(p, np.float32) for p in (hi, mid, x - hi - mid)]
    assert all(np.array_equal(np.asarray(jnp.asarray(p).astype(jnp.bfloat16), np.float32), p) for p in parts)
    for a, b, c in itertools.permutations(parts):
        np.testing.assert_array_equal((a + b) + c, values)

    n, rows, dv = 8, 128, 128
    block = rng.permutation(values)[: n * rows].reshape(n, rows)
    block[0, :3] = [tricky, -0.0, 2.0**-100]
    parts_t = _split_columns(jnp.asarray(block))
    for col in range(n):
        got_a, got_b = _lane_replicated(parts_t, col, (col + 3) % n, dv)
        for got, want in ((got_a, block[col]), (got_b, block[(col + 3) % n])):
            got = np.asarray(got)
            assert (got == want[:, None]).all() and (got.view(np.uint32) == (want + 0.0).view(np.uint32)[:, None]).all()
