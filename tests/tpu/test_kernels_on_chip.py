"""The Pallas kernels compiled by Mosaic on the chip against their jnp references on the host's CPU backend.

The kernels run as the model calls them (``interpret=False``, default block sizes on this chip, float32
inputs and caches / states); each reference runs on ``jax.devices("cpu")[0]`` under
``jax.default_matmul_precision("highest")``, so the reference is float32 arithmetic, not XLA:TPU's one-pass
bfloat16 default. Head layouts: every distinct one of the released models (model/catalog.py) plus the embedded
model's, with the released head counts. Step shapes:

- decode: one token per row (contexts ending on, just past and well past page boundaries) and a padding row;
- prefill: fresh prompts in one call (several query / token blocks) and a padding row;
- mixed: decode rows and prefill rows in one call (the scheduler's mixed step) and a padding row;
- continuing: chunks of prompts continuing a prefix the kernel itself wrote into the cache / state pools
  (chained calls, each kernel's pools carried into its next call, the reference's into its own), ending in a
  decode step.
- repeated (GDN): prompts of one repeated token, write strength near 1 and almost no decay, the chunk systems
  whose powers grow like binomial coefficients (kernels/gdn/unit_lower_inverse.py).

Only valid positions are compared (padding rows and tokens past a row's length hold anything); the KV caches must
match exactly past the trash page 0, the GDN states within the tolerance past the trash slot 0, and what a call
must not touch (the other layer) exactly.

Tolerance: ``|kernel - reference| <= 2e-5 + 2e-5 * |reference|`` elementwise. Both sides compute in float32; the
first run on a v5e measured agreement within 4e-6 on O(1) values, from summation order (a 256-wide head dim, the
online softmax over key blocks of 1024) and the GDN chunk inverse (recursive block inversion against a triangular
solve).
2e-5 is 5x that; an indexing, masking or layout bug shows as errors of 1e-2 or more.

Off the chip (the suite's CPU switch, tests/tpu/suite.py) the kernels run in interpret mode with fewer heads: one
KV head with the layout's query heads per KV head, two GDN key heads with the layout's value heads per key head.
That cut is sound because each kernel's per-head work is independent: attention attends each KV head with its own
query heads, and the GDN grid steps over key heads, each with its own value heads and states. The GDN value-block
placement (blocked or element-offset, kernel._v_group_specs) depends on the head count; the cut keeps it.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import record

from sglang_tpu_qwen.embedded.checkpoint import embedded_config_dict
from sglang_tpu_qwen.kernels.gdn import conv_pool
from sglang_tpu_qwen.kernels.gdn.kernel import fused_gdn
from sglang_tpu_qwen.kernels.gdn.reference import fused_gdn_reference
from sglang_tpu_qwen.kernels.ragged_paged_attention.head_major import HEAD_MAJOR
from sglang_tpu_qwen.kernels.ragged_paged_attention.kernel import ragged_paged_attention
from sglang_tpu_qwen.kernels.ragged_paged_attention.reference import ragged_paged_attention_reference
from sglang_tpu_qwen.model.catalog import MODEL_CONFIGS, model_config
from sglang_tpu_qwen.model.config import Qwen35MoeConfig

from .suite import interpret

RTOL = ATOL = 2e-5
NORM_TOL_SCALE = 4.0  # the fused output norm's epilogue (see _gdn_chain)
PAGE = 64  # the runtime's default page size on a TPU (args/server_args.py)
LAYERS, LAYER = 2, 1  # the kernels address one layer of a stacked pool; layer 0 must come back untouched
SLOTS = 8  # GDN state slots; slot 0 is the trash slot of padding rows


def _configs() -> dict[str, Qwen35MoeConfig]:
    """Every released text config of the catalog, plus the embedded model's."""
    configs = {name: model_config(name) for name in MODEL_CONFIGS}
    configs["embedded"] = Qwen35MoeConfig.from_hf_dict(embedded_config_dict())
    return configs


def _layouts(key: Any) -> dict[tuple[int, ...], list[str]]:
    """Distinct head layouts (``key(config)``) -> the models that have it."""
    out: dict[tuple[int, ...], list[str]] = {}
    for name, config in _configs().items():
        out.setdefault(key(config), []).append(name)
    return out


# (query heads, KV heads, head_dim) and (GDN key heads, value heads, dk, dv, conv kernel).
ATTENTION_LAYOUTS = _layouts(lambda c: (c.num_attention_heads, c.num_key_value_heads, c.head_dim))
GDN_LAYOUTS = _layouts(lambda c: (c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim,
                                  c.linear_value_head_dim, c.linear_conv_kernel_dim))
ATTENTION_IDS = [f"q{q}-kv{kv}-d{d}" for q, kv, d in ATTENTION_LAYOUTS]
GDN_IDS = [f"k{k}-v{v}-d{dk}x{dv}" for k, v, dk, dv, _ in GDN_LAYOUTS]

# Per (kernel, step, what): the worst absolute error and the largest share of the tolerance used, recorded in
# the run's summary at the module's end.
_WORST: dict[str, tuple[float, float]] = {}


@pytest.fixture(scope="module", autouse=True)
def _record_worst() -> Iterator[None]:
    yield
    where = "interpret mode on the CPU" if interpret() else f"Mosaic on {jax.devices()[0].device_kind}"
    for key, (err, share) in sorted(_WORST.items()):
        record(f"Pallas kernels ({where}) vs jnp reference on the CPU (float32, highest), all layouts",
               f"{key}: max abs error {err:.1e}, {share:.2f} of the tolerance")


def _devices() -> tuple[Any, Any]:
    """(the device the kernels run on: the chip, or the CPU with the switch; the host's CPU device)."""
    return jax.devices()[0], jax.devices("cpu")[0]


def _assert_close(key: str, got: Any, want: Any, mask: np.ndarray | None = None, scale: float = 1.0) -> None:
    """``got`` within ATOL + RTOL * |want| of ``want`` (at ``mask``), finite; the worst errors go to _WORST."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if mask is not None:
        got, want = got[mask], want[mask]
    assert got.size and np.all(np.isfinite(got)), key
    err = np.abs(got - want)
    tol = scale * (ATOL + RTOL * np.abs(want))
    worst = _WORST.get(key, (0.0, 0.0))
    _WORST[key] = (max(worst[0], float(err.max())), max(worst[1], float((err / tol).max())))
    bad = err > tol
    assert not bad.any(), (f"{key}: {int(bad.sum())} of {got.size} values off, max abs error {err.max():.2e} "
                           f"(tolerance {scale} x ({ATOL:.0e} + {RTOL:.0e} x |reference|))")


# ---- ragged paged attention ------------------------------------------------------------------------------------


def _attention_heads(layout: tuple[int, ...]) -> tuple[int, int, int]:
    """The layout's (query heads, KV heads, head_dim); off the chip one KV head with its query heads."""
    nq, nkv, hd = layout
    return (nq // nkv, 1, hd) if interpret() else (nq, nkv, hd)


@functools.cache
def _attention_reference() -> Any:
    return jax.jit(ragged_paged_attention_reference)


def _attention_chain(layout: tuple[int, ...], steps: list[tuple[list[int], int]], prefix: list[int],
                     seed: int, key: str) -> None:
    """Run ``steps`` ((new tokens per row, bucket T) each) through the kernel and the reference, each carrying
    its own caches, starting from rows with ``prefix`` tokens already in a random cache; compare every step's
    valid outputs and the caches at the end."""
    nq, nkv, hd = _attention_heads(layout)
    rng = np.random.default_rng(seed)
    chip, cpu = _devices()
    q_lens_all = np.asarray([q for q, _ in steps], np.int32)  # [steps, B]
    final = np.asarray(prefix, np.int32) + q_lens_all.sum(0)
    need = -(-final // PAGE)
    num_pages = int(need.sum()) + 3
    pool = iter(rng.permutation(np.arange(1, num_pages)))  # pages out of order, never the trash page 0
    page_table = np.zeros((len(final), max(1, int(need.max()))), np.int32)
    for b, n in enumerate(need):
        page_table[b, :n] = [next(pool) for _ in range(n)]
    cache_shape = (LAYERS, num_pages, PAGE, nkv, hd)
    k_cache = rng.standard_normal(cache_shape, np.float32)
    v_cache = rng.standard_normal(cache_shape, np.float32)
    ker = [jax.device_put(HEAD_MAJOR.stored(c), chip) for c in (k_cache, v_cache)]  # the kernel's layout
    ref = [jax.device_put(k_cache, cpu), jax.device_put(v_cache, cpu)]
    kv_lens = np.asarray(prefix, np.int32)
    for q_lens, t in steps:
        q_lens = np.asarray(q_lens, np.int32)
        kv_lens = kv_lens + q_lens
        b = len(q_lens)
        step = dict(q=rng.standard_normal((b, t, nq, hd), np.float32),
                    k_new=rng.standard_normal((b, t, nkv, hd), np.float32),
                    v_new=rng.standard_normal((b, t, nkv, hd), np.float32),
                    q_lens=q_lens, kv_lens=kv_lens.copy(), page_table=page_table)
        out_k, *ker = ragged_paged_attention(**{k: jax.device_put(v, chip) for k, v in step.items()},
                                             k_cache=ker[0], v_cache=ker[1], layer=LAYER, interpret=interpret())
        with jax.default_matmul_precision("highest"):
            out_r, *ref = _attention_reference()(**{k: jax.device_put(v, cpu) for k, v in step.items()},
                                                 k_cache=ref[0], v_cache=ref[1], layer=LAYER)
        out_k, out_r = np.asarray(out_k), np.asarray(out_r)
        assert out_k.shape == out_r.shape == (b, t, nq, hd)
        _assert_close(f"attention {key}: output", out_k, out_r, np.arange(t)[None, :] < q_lens[:, None])
        assert np.all(out_k[q_lens == 0] == 0)  # a padding row's output is zeros
    for got, want, before in zip(ker, ref, (k_cache, v_cache), strict=True):
        got, want = np.asarray(HEAD_MAJOR.logical(got, nkv)), np.asarray(want)
        np.testing.assert_array_equal(got[LAYER, 1:], want[LAYER, 1:])  # the reference writes padding to page 0
        np.testing.assert_array_equal(got[1 - LAYER], before[1 - LAYER])


# name -> (rows' cached prefix, [(new tokens per row, bucket T), ...]).
ATTENTION_STEPS: dict[str, tuple[list[int], list[tuple[list[int], int]]]] = {
    # Contexts ending on, just past and well past page boundaries and key blocks, and a padding row.
    "decode": ([63, 64, 0, 127, 300, 1, 1023, 1500, 191, 0], [([1, 1, 1, 1, 1, 1, 1, 1, 1, 0], 1)]),
    "prefill": ([0, 0, 0], [([64, 37, 0], 64)]),
    # An MTP verify: 4 tokens a row, many rows a grid step, contexts ending mid key block (pages past the last
    # visible key not fetched), a short row and a padding row.
    "verify": ([575, 60, 0, 1020, 127, 0, 300], [([4, 4, 3, 4, 4, 0, 1], 4)]),
    "mixed": ([40, 0, 15, 0, 7], [([1, 64, 1, 29, 0], 64)]),
    # Fresh prompts, then chunks over what the kernel wrote (one on a page boundary, one not), a decode row in
    # a chunk's bucket, then a decode step.
    "continuing": ([0, 0, 0], [([64, 64, 30], 64), ([64, 21, 1], 64), ([1, 33, 1], 64), ([1, 1, 1], 1)]),
}


@pytest.mark.parametrize("step", ATTENTION_STEPS)
@pytest.mark.parametrize("layout", ATTENTION_LAYOUTS, ids=ATTENTION_IDS)
def test_ragged_paged_attention_matches_reference(layout: tuple[int, ...], step: str) -> None:
    prefix, steps = ATTENTION_STEPS[step]
    _attention_chain(layout, steps, prefix, seed=list(ATTENTION_STEPS).index(step) * 1000 + sum(layout), key=step)


# ---- fused conv1d + Gated DeltaNet -----------------------------------------------------------------------------


def _gdn_heads(layout: tuple[int, ...]) -> tuple[int, int, int, int, int]:
    """The layout's (Hk, Hv, dk, dv, K); off the chip two key heads with the layout's value heads per key head."""
    hk, hv, dk, dv, k = layout
    if not interpret():
        return layout
    r = hv // hk
    blocked = (2 * hk * dk) % (r * dv) == 0  # kernel._v_group_specs: blocked or element-offset v windows
    assert blocked == ((2 * 2 * dk) % (r * dv) == 0), layout  # the cut keeps the kernel's path
    return 2, 2 * r, dk, dv, k


@functools.cache
def _gdn_reference() -> Any:
    return jax.jit(fused_gdn_reference, static_argnames=("num_k_heads", "head_k_dim", "head_v_dim", "norm_eps"))


def _gdn_chain(layout: tuple[int, ...], slots: list[int], steps: list[tuple[list[int], int, bool]], seed: int,
               key: str, norm: bool = False, repeated: bool = False) -> None:
    """Run ``steps`` ((valid tokens per row, bucket T, rows start fresh) each) through the kernel and the
    reference over the rows' state ``slots``, each side carrying its own pools (random at the start: a prefix
    already in the state); compare every step's valid outputs and the pools at the end. ``norm``: with the
    fused gated output norm, as the model calls the kernel. ``repeated``: each row's tokens are one repeated
    input, write strength in [0.95, 1] and log-decay in [-0.01, 0] (chunk systems whose powers of L grow
    like binomial coefficients)."""
    hk, hv, dk, dv, k = _gdn_heads(layout)
    rng = np.random.default_rng(seed)
    chip, cpu = _devices()
    conv_dim = 2 * hk * dk + hv * dv
    conv_w = (rng.standard_normal((conv_dim, k)) * 0.5).astype(np.float32)
    conv0 = rng.standard_normal(conv_pool.pool_shape(LAYERS, SLOTS, conv_dim, k - 1)).astype(np.float32)
    rec0 = (rng.standard_normal((LAYERS, SLOTS, hv, dk, dv)) * 0.1).astype(np.float32)
    ker = [jax.device_put(conv0, chip), jax.device_put(rec0, chip)]
    ref = [jax.device_put(conv0, cpu), jax.device_put(rec0, cpu)]
    dims = dict(num_k_heads=hk, head_k_dim=dk, head_v_dim=dv)
    b = len(slots)
    for lens, t, fresh in steps:
        lens = np.asarray(lens, np.int32)
        valid = np.arange(t)[None, :] < lens[:, None]
        shape = (b, 1, conv_dim) if repeated else (b, t, conv_dim)
        g_max, beta_low = (0.01, 0.95) if repeated else (0.5, 0.0)
        step = dict(
            mixed=(np.broadcast_to(rng.standard_normal(shape), (b, t, conv_dim)) * valid[..., None]).astype(np.float32),
            conv_weight=conv_w,
            g=(-rng.uniform(0.0, g_max, (b, t, hv)) * valid[..., None]).astype(np.float32),  # log-decay <= 0
            beta=(rng.uniform(beta_low, 1.0, (b, t, hv)) * valid[..., None]).astype(np.float32),
            slot_ids=np.asarray(slots, np.int32), new_lens=lens, fresh=np.full(b, fresh))
        if norm:
            step["gate"] = (rng.standard_normal((b, t, hv * dv)) * 2).astype(np.float32)
            step["norm_weight"] = (1 + rng.standard_normal(dv) * 0.3).astype(np.float32)
        out_k, *ker = fused_gdn(**{n: jax.device_put(v, chip) for n, v in step.items()}, conv_pool=ker[0],
                                rec_pool=ker[1], layer=LAYER, interpret=interpret(), **dims)
        with jax.default_matmul_precision("highest"):
            out_r, *ref = _gdn_reference()(**{n: jax.device_put(v, cpu) for n, v in step.items()},
                                           conv_pool=ref[0], rec_pool=ref[1], layer=LAYER, **dims)
        assert out_k.shape == out_r.shape == (b, t, hv, dv)
        # The fused output norm's rsqrt and sigmoid are the TPU's own approximations (a few 1e-6 relative off
        # the CPU's), scaled by outputs up to ~45: 3 of 217,088 values sat at 1.02x the plain tolerance on the chip.
        _assert_close(f"GDN {key}: output", out_k, out_r, valid, scale=NORM_TOL_SCALE if norm else 1.0)
    conv_k, rec_k = (np.asarray(x) for x in ker)
    conv_r, rec_r = (np.asarray(x) for x in ref)
    # Past the trash slot 0 (the conv pool's first K-1 rows, the recurrent pool's first slot).
    _assert_close(f"GDN {key}: conv state", conv_k[LAYER, k - 1 :], conv_r[LAYER, k - 1 :])
    _assert_close(f"GDN {key}: recurrent state", rec_k[LAYER, 1:], rec_r[LAYER, 1:])
    np.testing.assert_array_equal(conv_k[1 - LAYER], conv0[1 - LAYER])
    np.testing.assert_array_equal(rec_k[1 - LAYER], rec0[1 - LAYER])
    unused = sorted(set(range(1, SLOTS)) - set(slots))
    np.testing.assert_array_equal(rec_k[LAYER, unused], rec0[LAYER, unused])  # slots of no row: untouched


# name -> (each row's state slot, [(valid tokens per row, bucket T, rows start fresh), ...]).
GDN_STEPS: dict[str, tuple[list[int], list[tuple[list[int], int, bool]]]] = {
    # Slots out of order; a padding row on the trash slot.
    "decode": ([5, 2, 7, 3, 0], [([1, 1, 1, 1, 0], 1, False)]),
    # 300 tokens: two token blocks of 256 (the second partial), the other row ends inside the first.
    "prefill": ([3, 6], [([300, 129], 300, True)]),
    "mixed": ([4, 1, 6, 2, 0], [([1, 64, 1, 40, 0], 64, False)]),
    # Fresh prompts, then chunks continuing the states the kernel wrote (a decode row inside a chunk's bucket),
    # then a decode step.
    "continuing": ([3, 5, 1], [([128, 70, 128], 128, True), ([128, 1, 44], 128, False), ([44, 1, 1], 64, False),
                               ([1, 1, 1], 1, False)]),
    # The recurrent form of short steps (a speculative verify's k + 1 = 4 tokens; T <= kernel.RECURRENT_MAX_T):
    # ragged rows and a padding row, a commit-like step (fewer valid tokens than T), then 8 tokens.
    "short": ([5, 2, 7, 3, 0], [([4, 4, 2, 1, 0], 4, False), ([3, 4, 1, 0, 0], 4, False), ([8, 5, 8, 8, 0], 8, False)]),
}


@pytest.mark.parametrize("step", GDN_STEPS)
@pytest.mark.parametrize("layout", GDN_LAYOUTS, ids=GDN_IDS)
def test_fused_gdn_matches_reference(layout: tuple[int, ...], step: str) -> None:
    slots, steps = GDN_STEPS[step]
    _gdn_chain(layout, slots, steps, seed=list(GDN_STEPS).index(step) * 1000 + sum(layout), key=step)


@pytest.mark.parametrize("layout", GDN_LAYOUTS, ids=GDN_IDS)
def test_fused_gdn_repeated_token_prefill(layout: tuple[int, ...]) -> None:
    """Prompts of one repeated token with write strength near 1 and almost no decay: chunk systems whose
    inverse the nilpotent product got wrong by 1e20 (kernels/gdn/unit_lower_inverse.py)."""
    slots, steps = GDN_STEPS["prefill"]
    _gdn_chain(layout, slots, steps, seed=11 + sum(layout), key="repeated", repeated=True)


@pytest.mark.parametrize("step", ["mixed", "decode"])
@pytest.mark.parametrize("layout", GDN_LAYOUTS, ids=GDN_IDS)
def test_fused_gdn_output_norm_matches_reference(layout: tuple[int, ...], step: str) -> None:
    """The model's call, with the gated RMSNorm (float32 gate and weight): fused into the kernel's epilogue for
    a mixed step, applied by XLA after the kernel for a decode step."""
    slots, steps = GDN_STEPS[step]
    _gdn_chain(layout, slots, steps, seed=7 + sum(layout), key=f"{step}, output norm", norm=True)


def _bits_on_chip(got: np.ndarray, want: np.ndarray) -> None:
    """Equal bit for bit on the chip; within ATOL in interpret mode, where XLA:CPU fuses two interpreted programs
    of the same arithmetic differently (last-bit differences)."""
    if interpret():
        np.testing.assert_allclose(got, want, rtol=0, atol=ATOL)
    else:
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("layout", GDN_LAYOUTS, ids=GDN_IDS)
def test_fused_gdn_short_step_is_decode_steps(layout: tuple[int, ...]) -> None:
    """A speculative verify's 4 tokens through the recurrent form equal 4 decode calls bit for bit on the chip
    (outputs with the model's output norm, both pools): the kernel runs _decode_head per token, so speculative
    == plain greedy can hold exactly. ``commit=False`` gives the same outputs and leaves both pools as they
    were, and copy_slots copies exactly the snapshot rows' slots. Off the chip (interpret mode) XLA:CPU fuses
    the two programs differently and the outputs may differ in the last bits, so there the check is ATOL."""
    from sglang_tpu_qwen.kernels.gdn.slot_copy import copy_slots

    hk, hv, dk, dv, k = _gdn_heads(layout)
    rng = np.random.default_rng(4242 + sum(layout))
    chip, _ = _devices()
    conv_dim = 2 * hk * dk + hv * dv
    b, t = 4, 4
    put = functools.partial(jax.device_put, device=chip)
    conv_w = put((rng.standard_normal((conv_dim, k)) * 0.5).astype(np.float32))
    conv0 = rng.standard_normal(conv_pool.pool_shape(LAYERS, SLOTS, conv_dim, k - 1)).astype(np.float32)
    rec0 = (rng.standard_normal((LAYERS, SLOTS, hv, dk, dv)) * 0.1).astype(np.float32)
    mixed = put(rng.standard_normal((b, t, conv_dim)).astype(np.float32))
    g = put((-rng.uniform(0.0, 0.5, (b, t, hv))).astype(np.float32))
    beta = put(rng.uniform(0.0, 1.0, (b, t, hv)).astype(np.float32))
    gate = put((rng.standard_normal((b, t, hv * dv)) * 2).astype(np.float32))
    weight = put((1 + rng.standard_normal(dv) * 0.3).astype(np.float32))
    slots, fresh = put(np.asarray([5, 2, 7, 3], np.int32)), put(np.zeros(b, bool))
    kw = dict(num_k_heads=hk, head_k_dim=dk, head_v_dim=dv, norm_weight=weight, interpret=interpret())
    lens = put(np.full(b, t, np.int32))
    o_v, conv_v, rec_v = fused_gdn(mixed, conv_w, g, beta, put(conv0), put(rec0), LAYER, slots, lens, fresh,
                                   gate=gate, commit=False, **kw)
    np.testing.assert_array_equal(np.asarray(conv_v), conv0)
    np.testing.assert_array_equal(np.asarray(rec_v), rec0)
    o_4, *pools_4 = fused_gdn(mixed, conv_w, g, beta, put(conv0), put(rec0), LAYER, slots, lens, fresh, gate=gate,
                              **kw)
    _bits_on_chip(np.asarray(o_v), np.asarray(o_4))
    pools_1 = [put(conv0), put(rec0)]
    one = put(np.ones(b, np.int32))
    for i in range(t):
        o_1, *pools_1 = fused_gdn(mixed[:, i : i + 1], conv_w, g[:, i : i + 1], beta[:, i : i + 1], *pools_1, LAYER,
                                  slots, one, fresh, gate=gate[:, i : i + 1], **kw)
        _bits_on_chip(np.asarray(o_4[:, i]), np.asarray(o_1[:, 0]))
    for x4, x1 in zip(pools_4, pools_1, strict=True):
        _bits_on_chip(np.asarray(x4), np.asarray(x1))
    # The decode snapshot: rows 0 and 2 copy their slots to 6 and 1; rows 1 and 3 (dst 0) copy nothing.
    want_conv, want_rec = (np.array(x) for x in pools_4)
    conv_s, rec_s = copy_slots(*pools_4, slots, put(np.asarray([6, 0, 1, 0], np.int32)), taps=k - 1,
                               interpret=interpret())  # donates pools_4
    for src, dst in ((5, 6), (7, 1)):
        want_rec[:, dst] = want_rec[:, src]
        want_conv[:, dst * (k - 1) : (dst + 1) * (k - 1)] = want_conv[:, src * (k - 1) : (src + 1) * (k - 1)]
    np.testing.assert_array_equal(np.asarray(rec_s), want_rec)
    np.testing.assert_array_equal(np.asarray(conv_s), want_conv)


@pytest.mark.parametrize("state_dtype", [np.float32, jax.numpy.bfloat16], ids=["f32-state", "bf16-state"])
def test_fused_gdn_verify_is_the_committing_call(state_dtype: Any) -> None:
    """A verify call (``commit=False``: each value head's tokens with its state in registers) gives the committing
    call's outputs bit for bit on the chip, for rows of 4, 2, 1 and 0 (padding, trash slot) tokens, one fresh,
    with the pool's state in float32 or bfloat16 (rounded between tokens either way); within ATOL off the chip,
    where XLA:CPU fuses the two interpreted programs differently. 35B layout."""
    hk, hv, dk, dv, k = 16, 32, 128, 128, 4
    rng = np.random.default_rng(4343)
    chip, _ = _devices()
    conv_dim = 2 * hk * dk + hv * dv
    b, t = 4, 4
    put = functools.partial(jax.device_put, device=chip)
    lens_np = np.asarray([4, 2, 1, 0], np.int32)
    live = (np.arange(t)[None, :] < lens_np[:, None])[..., None]
    conv_w = put((rng.standard_normal((conv_dim, k)) * 0.5).astype(np.float32))
    conv0 = rng.standard_normal(conv_pool.pool_shape(LAYERS, SLOTS, conv_dim, k - 1)).astype(np.float32)
    rec0 = (rng.standard_normal((LAYERS, SLOTS, hv, dk, dv)) * 0.1).astype(state_dtype)
    mixed = put(np.where(live, rng.standard_normal((b, t, conv_dim)), 0).astype(np.float32))
    g = put(np.where(live, -rng.uniform(0.0, 0.5, (b, t, hv)), 0).astype(np.float32))
    beta = put(np.where(live, rng.uniform(0.0, 1.0, (b, t, hv)), 0).astype(np.float32))
    slots, fresh = put(np.asarray([5, 2, 7, 0], np.int32)), put(np.asarray([False, True, False, False]))
    kw = dict(num_k_heads=hk, head_k_dim=dk, head_v_dim=dv, interpret=interpret())
    args = (mixed, conv_w, g, beta)
    o_v, _, rec_v = fused_gdn(*args, put(conv0), put(rec0), LAYER, slots, put(lens_np), fresh, commit=False, **kw)
    o_c, *_ = fused_gdn(*args, put(conv0), put(rec0), LAYER, slots, put(lens_np), fresh, **kw)
    np.testing.assert_array_equal(np.asarray(rec_v), rec0)
    _bits_on_chip(np.asarray(o_v), np.asarray(o_c))


@pytest.mark.parametrize("dtype", [np.float32, jax.numpy.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("layout", GDN_LAYOUTS, ids=GDN_IDS)
def test_conv_window_dma_equals_xla(layout: tuple[int, ...], dtype: Any) -> None:
    """The conv windows fused_gdn moves by DMA (kernels/gdn/window_copy.py) equal XLA's gather and scatter on the
    same device bit for bit, at a decode step's 256 rows (a quarter of them padding rows on the trash slot 0):
    the gathered windows, and the pool after the scatter past slot 0, which holds one padding row's window."""
    from sglang_tpu_qwen.kernels.gdn.window_copy import gather_windows_dma, scatter_windows_dma

    hk, hv, dk, dv, k = _gdn_heads(layout)
    conv_dim, taps = 2 * hk * dk + hv * dv, k - 1
    rows, slots_n = (256, 300) if not interpret() else (12, 16)
    rng = np.random.default_rng(77 + sum(layout))
    chip, _ = _devices()
    put = functools.partial(jax.device_put, device=chip)
    pool0 = rng.standard_normal(conv_pool.pool_shape(LAYERS, slots_n, conv_dim, taps)).astype(dtype)
    real = rng.permutation(np.arange(1, slots_n))[: rows - rows // 4]
    slots = rng.permutation(np.concatenate([real, np.zeros(rows // 4, np.int64)])).astype(np.int32)
    windows = rng.standard_normal((rows, taps, conv_dim)).astype(np.float32)  # cast to the pool's dtype
    got = gather_windows_dma(put(pool0), LAYER, put(slots), taps, interpret=interpret())
    want = jax.jit(conv_pool.gather_windows, static_argnums=3)(put(pool0), LAYER, put(slots), taps)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    want = np.asarray(jax.jit(conv_pool.scatter_windows)(put(pool0), LAYER, put(slots), put(windows)))
    got = np.asarray(scatter_windows_dma(put(pool0), LAYER, put(slots), put(windows), interpret=interpret()))
    np.testing.assert_array_equal(got[:, taps:], want[:, taps:])
    np.testing.assert_array_equal(got[1 - LAYER], pool0[1 - LAYER])
    trash = got[LAYER, :taps].reshape(taps, conv_dim)
    assert any(np.array_equal(trash, w) for w in windows[slots == 0].astype(dtype))


# ---- the expert-by-expert SwiGLU FFN (kernels/grouped_ffn: prefill, and verify-sized steps' 32-row tiles) ----


@pytest.mark.parametrize("tm", [8, 32, 128, 256])
def test_grouped_ffn_matches_reference(tm: int) -> None:
    """kernels/grouped_ffn compiled by Mosaic against its ragged_dot reference on the CPU (float32, highest), at
    the 35B-A3B's expert width on 16 experts (off the chip: 256 wide, interpreted), with tiles of one float32
    sublane tile (8 rows), the verify-sized steps' 32 and the prefill's: untouched experts, experts
    whose first row is off a sublane tile (their kept rows come from the last tile in VMEM), one over several
    tiles, and the array's last tile clamped back over two experts (its kept rows read back from HBM). Every row
    is covered. SiLU's sigmoid takes the fused-norm test's 4x tolerance (the TPU's approximation)."""
    from sglang_tpu_qwen.kernels.grouped_ffn.kernel import grouped_ffn
    from sglang_tpu_qwen.kernels.grouped_ffn.reference import grouped_ffn_reference

    h, i = (256, 128) if interpret() else (2048, 512)
    sizes = np.asarray([40, 0, 77, 3, 0, 24, 100, 0, 0, 60, 33, 0, 90, 5, 0, 80], np.int32)  # 512 rows
    rng = np.random.default_rng(91 + tm)
    x = rng.standard_normal((int(sizes.sum()), h)).astype(np.float32)
    w_gate, w_up = (rng.standard_normal((len(sizes), h, i)).astype(np.float32) / np.sqrt(h) for _ in range(2))
    w_down = rng.standard_normal((len(sizes), i, h)).astype(np.float32) / np.sqrt(i)
    chip, cpu = _devices()
    args = (x, w_gate, w_up, w_down, sizes)
    got = grouped_ffn(*(jax.device_put(a, chip) for a in args), tm=tm, interpret=interpret())
    with jax.default_matmul_precision("highest"):
        want = jax.jit(grouped_ffn_reference)(*(jax.device_put(a, cpu) for a in args))
    _assert_close(f"grouped_ffn tm {tm}: output", got, want, scale=NORM_TOL_SCALE)


# ---- the greedy lm_head (kernels/greedy_head, --sampling-backend pallas) ---------------------------------------


@pytest.mark.parametrize(("rows", "vocab"), [(64, 248320), (13, 151936), (256, 248320)],
                         ids=["decode", "ragged", "verify"])
def test_greedy_lm_head_matches_reference(rows: int, vocab: int) -> None:
    """kernels/greedy_head compiled by Mosaic against the argmax of the float32 logits on the CPU (highest) of
    the same bfloat16 operands, at the 35B-A3B's hidden size (off the chip: 256 wide, a 2,560 / 3,000-row
    vocabulary, interpreted): Qwen3.5's vocabulary, Qwen3's (no multiple of the kernel's 1,280-row block: its
    last block runs past the weight), and a verify step's 256 rows. Each id must reach its row's maximum within
    2^-10 of the row's largest |logit| (the two sum the exact products in different orders), and rows whose top
    two logits are further apart than that must give the reference's id. Row 1's hidden state holds a NaN: its id is 0,
    the first NaN (jnp.argmax's rule). The kernel is compiled under ``highest`` as the suite's engines are: its
    bfloat16 product names its one pass (utils/mxu_precision.py)."""
    from sglang_tpu_qwen.kernels.greedy_head.kernel import greedy_lm_head

    h, v = (256, 2560 if vocab % 1280 == 0 else 3000) if interpret() else (2048, vocab)
    rng = np.random.default_rng(rows + vocab)
    hidden = rng.standard_normal((rows, h)).astype(jnp.bfloat16)
    hidden[1, 5] = np.nan
    weight = (rng.standard_normal((v, h)) / np.sqrt(h)).astype(jnp.bfloat16)
    chip, cpu = _devices()
    with jax.default_matmul_precision("highest"):
        ids = np.asarray(greedy_lm_head(jax.device_put(hidden, chip), jax.device_put(weight, chip),
                                        interpret=interpret()))
        logits = np.asarray(jnp.einsum("nh,vh->nv", jax.device_put(hidden.astype(np.float32), cpu),
                                       jax.device_put(weight.astype(np.float32), cpu)))
    assert ids.shape == (rows,) and ids.min() >= 0 and ids.max() < v
    assert ids[1] == 0
    ids, logits = np.delete(ids, 1), np.delete(logits, 1, axis=0)
    tol = 2.0**-10 * np.abs(logits).max(axis=1)
    top2 = np.sort(logits, axis=1)[:, -2:]
    reached = logits[np.arange(rows - 1), ids]
    assert np.all(reached >= top2[:, 1] - tol), np.nonzero(reached < top2[:, 1] - tol)
    clear = top2[:, 1] - top2[:, 0] > tol
    np.testing.assert_array_equal(ids[clear], logits.argmax(axis=1)[clear])
    assert clear.mean() > 0.9  # the comparison is not vacuous
