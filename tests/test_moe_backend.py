"""The MoE backend (kernels/moe_backend.py, issue 42): ``--moe-runner-backend`` resolves per flag and platform, and
its two kinds compute the same grouped matmuls. ``reference`` dequantises block-FP8 weights in XLA and runs
``ragged_dot``; ``pallas`` runs the Pallas block-FP8 kernels (interpret mode on CPU). Dense weights take the same
XLA path under both.

Tolerance: float32 inputs and accumulators; the kernel sums 128-row partial products, each scaled per block,
in another order than one dot over the dequantised matrix, so the two agree to ~1e-6 of the largest magnitude;
we allow 1e-5 (as tests/test_fp8_matmul.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sglang_tpu_qwen.args.server_args import ServerArgs, prepare_server_args
from sglang_tpu_qwen.kernels.dispatch import KernelBackends, resolve_backends
from sglang_tpu_qwen.kernels.moe_backend import MoeBackend
from sglang_tpu_qwen.quant import fp8

TOL = 1e-5
REFERENCE, PALLAS = MoeBackend("reference"), MoeBackend("pallas", interpret=True)


def _rel(got: jax.Array, want: jax.Array) -> float:
    return float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))


def _fp8(rng: np.random.Generator, shape: tuple[int, ...]) -> fp8.Fp8Weight:
    return fp8.quantize(jnp.asarray(rng.standard_normal(shape), jnp.float32))


# ---------------------------------------------------------------- resolution


@pytest.mark.parametrize(("flag", "platform", "name", "interpret"), [
    ("auto", "tpu", "pallas", False), ("auto", "cpu", "reference", False),
    ("pallas", "tpu", "pallas", False), ("pallas", "cpu", "pallas", True),
    ("reference", "tpu", "reference", False), ("reference", "cpu", "reference", False),
])
def test_moe_backend_resolves_per_flag(flag, platform, name, interpret):
    """auto = pallas on a TPU, else reference; pallas off a TPU runs in interpret mode; the other layer kinds'
    backends are not touched by the flag."""
    got = resolve_backends("reference", "reference", platform=platform, moe=flag)
    assert got.moe == MoeBackend(name, interpret=interpret)
    assert (got.attention.name, got.gdn.name, got.interpret) == ("reference", "reference", interpret)
    assert got == KernelBackends.of("reference", "reference", interpret, platform, moe=name)


def test_moe_backend_defaults_and_bad_names():
    # KernelBackends.of without a MoE name takes auto's choice for its platform (the FP8 matmuls' kernel was
    # chosen by platform before the flag existed); a bare KernelBackends() is the reference, like its others.
    assert KernelBackends.of(platform="tpu").moe.name == "pallas"
    assert KernelBackends.of(platform="cpu").moe.name == "reference"
    assert KernelBackends().moe == MoeBackend("reference")
    with pytest.raises(ValueError, match="--moe-runner-backend must be one of auto, pallas, reference"):
        resolve_backends(platform="cpu", moe="triton")
    with pytest.raises(ValueError, match="unknown MoE backend 'triton'"):
        MoeBackend("triton")


def test_moe_runner_backend_flag():
    assert ServerArgs().moe_runner_backend == "auto"
    assert prepare_server_args(["--moe-runner-backend", "reference"]).moe_runner_backend == "reference"
    with pytest.raises(ValueError, match="--moe-runner-backend must be one of auto, pallas, reference"):
        ServerArgs(moe_runner_backend="deep_gemm")


def test_kernel_rows_follow_the_consumer():
    """Row-tiled token rows only where the Pallas kernel reads them (FP8 weights, 128 | width)."""
    w = _fp8(np.random.default_rng(0), (2, 256, 128))
    assert PALLAS.kernel_rows(w, 256) == (2, 128)
    assert PALLAS.kernel_rows(w, 200) == (200,)
    assert REFERENCE.kernel_rows(w, 256) == (256,)
    assert PALLAS.kernel_rows(jnp.zeros((2, 256, 128)), 256) == (256,)


# ---------------------------------------------------------------- the two kinds agree


def test_reference_and_pallas_grouped_fp8_matmuls_agree():
    """``grouped`` (partial edge blocks, an empty group, rows past the groups, one layer of a stacked weight
    read in place), ``grouped_swiglu`` (row scale, rows gathered by id from row-tiled tokens) and ``linear``
    give the same result under both backends."""
    rng = np.random.default_rng(42)
    m, k, n, sizes = 40, 300, 200, [7, 0, 20, 5]
    gs = jnp.asarray(sizes, jnp.int32)
    covered = sum(sizes)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    w = _fp8(rng, (len(sizes), k, n))
    with jax.default_matmul_precision("highest"):
        ref, pal = REFERENCE.grouped(x, w, gs), PALLAS.grouped(x, w, gs)
        assert np.all(np.asarray(ref)[covered:] == 0) and np.all(np.asarray(pal)[covered:] == 0)
        assert _rel(pal, ref) < TOL

        # Layer 1 of a [L, G, K, N] stack, as the forward's scan hands it (quant/fp8.py LayerSlice).
        stack = jnp.stack([_fp8(rng, (len(sizes), k, n)).q, w.q])
        sliced = fp8.Fp8Weight(q=fp8.LayerSlice(stack, jnp.int32(1)), scale=w.scale, block=w.block)
        assert _rel(PALLAS.grouped(x, sliced, gs), ref) < TOL
        assert _rel(REFERENCE.grouped(x, sliced, gs), ref) < TOL

        # Gate/up with SwiGLU and the routing weight; the rows gathered from [S, K / 128, 128] tokens.
        kk, s = 256, 30
        wg, wu = _fp8(rng, (len(sizes), kk, n)), _fp8(rng, (len(sizes), kk, n))
        src = jnp.asarray(rng.standard_normal((s, kk)), jnp.float32)
        ids = jnp.asarray(rng.integers(0, s, m), jnp.int32)
        rs = jnp.asarray(rng.uniform(0.1, 1.0, m), jnp.float32)
        act = {b.name: b.grouped_swiglu(src.reshape(s, *b.kernel_rows(wg, kk)), wg, wu, gs, rs, row_ids=ids)
               for b in (REFERENCE, PALLAS)}
        assert _rel(act["pallas"][:covered], act["reference"][:covered]) < TOL

        # linear: one group of the same kernel, with leading batch dims.
        one = fp8.Fp8Weight(q=w.q[2], scale=w.scale[2], block=w.block)
        xb = x.reshape(5, 8, k)
        assert _rel(PALLAS.linear(xb, one), REFERENCE.linear(xb, one)) < TOL


def test_reference_and_pallas_scatter_add_agree():
    """The expert-parallel down projection summed into its tokens' rows, each backend in its own row layout:
    into a given accumulator, and into a new one whose first rows overwrite and whose unreached rows are
    zeroed."""
    rng = np.random.default_rng(7)
    m, k, n, r, sizes = 40, 300, 256, 24, [7, 0, 20, 5]
    gs = jnp.asarray(sizes, jnp.int32)
    covered = sum(sizes)
    w = _fp8(rng, (len(sizes), k, n))
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    dest = jnp.asarray([int(d) for s in sizes for d in rng.choice(r, s, replace=False)]
                       + list(rng.integers(0, r, m - covered)), jnp.int32)
    acc = jnp.asarray(rng.standard_normal((r, n)), jnp.float32)
    touched, first = np.unique(np.asarray(dest)[:covered], return_index=True)
    overwrite = jnp.zeros(m, bool).at[first].set(True)
    zero_rows = jnp.asarray(np.concatenate([np.setdiff1d(np.arange(r), touched), [-1]]), jnp.int32)
    got = {}
    with jax.default_matmul_precision("highest"):
        for b in (REFERENCE, PALLAS):
            rows = b.kernel_rows(w, n)
            added = b.grouped_scatter_add(x, w, gs, dest, acc.reshape(r, *rows))
            fresh = b.grouped_scatter_add(x, w, gs, dest, None, overwrite, zero_rows, num_rows=r)
            assert added.shape == fresh.shape == (r, *rows)
            got[b.name] = (added.reshape(r, n), fresh.reshape(r, n))
    for ref, pal in zip(got["reference"], got["pallas"], strict=True):
        assert _rel(pal, ref) < TOL


def test_dense_weights_take_one_path():
    """Dense expert stacks go to ``ragged_dot`` under either backend: bitwise the same."""
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((12, 16)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((3, 16, 8)), jnp.float32)
    gs = jnp.asarray([4, 0, 6], jnp.int32)
    np.testing.assert_array_equal(np.asarray(PALLAS.grouped(x, w, gs)), np.asarray(REFERENCE.grouped(x, w, gs)))
    np.testing.assert_array_equal(np.asarray(PALLAS.linear(x, w[0])), np.asarray(REFERENCE.linear(x, w[0])))


# ---------------------------------------------------------------- routing without scatters


def test_group_counts_and_inverse_sort_equal_the_scatters() -> None:
    """model/moe.py routes without XLA scatters (the v5e runs them an element at a time): ``group_counts`` equals
    ``bincount`` over the ids in range (out-of-range ids, another device's pairs under EP, are not counted), and
    the inverse permutation by ``argsort(order)`` equals the scattered one; ``routed_experts`` then equals the
    dense sum over every expert."""
    from sglang_tpu_qwen.model.moe import all_experts, group_counts, routed_experts

    rng = np.random.default_rng(4)
    ids = rng.integers(0, 9, size=500).astype(np.int32)
    np.testing.assert_array_equal(np.asarray(group_counts(jnp.asarray(ids), 8)), np.bincount(ids, minlength=9)[:8])
    order = jnp.argsort(jnp.asarray(ids), stable=True)
    scattered = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
    np.testing.assert_array_equal(np.asarray(jnp.argsort(order)), np.asarray(scattered))
    n, h, i, e, k = 40, 16, 8, 6, 2
    x = jnp.asarray(rng.standard_normal((n, h)), jnp.float32)
    w = [jnp.asarray(rng.standard_normal(s) * 0.3, jnp.float32) for s in ((e, h, i), (e, h, i), (e, i, h))]
    expert_ids = jnp.asarray(np.argsort(rng.random((n, e)), axis=1)[:, :k], jnp.int32)
    weights = jnp.asarray(rng.random((n, k)), jnp.float32)
    with jax.default_matmul_precision("highest"):
        got, want = routed_experts(x, weights, expert_ids, *w), all_experts(x, weights, expert_ids, *w)
    assert _rel(got, want) < TOL


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_pallas_routes_dense_experts_through_the_fused_ffn(dtype, monkeypatch) -> None:
    """Under ``pallas`` a dense MoE step of at least ``ffn_kernel_min_rows_per_expert`` rows an expert (H a
    multiple of 128, the blocks within ``FFN_KERNEL_MAX_VMEM``) runs kernels/grouped_ffn: ``routed_experts`` then
    equals the reference backend's two ``ragged_dot`` products within the float32 tolerance (bf16: one rounding
    of the activation, 2^-6 of the largest output). A step with fewer rows an expert, or blocks past the VMEM
    budget, runs the two products: bit for bit the reference's."""
    from sglang_tpu_qwen.kernels import moe_backend
    from sglang_tpu_qwen.model.moe import routed_experts

    rng = np.random.default_rng(9)
    n, h, i, e, k = 24, 128, 64, 6, 2
    x = jnp.asarray(rng.standard_normal((n, h)), dtype)
    w = [jnp.asarray(rng.standard_normal(s) * 0.1, dtype) for s in ((e, h, i), (e, h, i), (e, i, h))]
    expert_ids = jnp.asarray(np.argsort(rng.random((n, e)), axis=1)[:, :k], jnp.int32)
    weights = jnp.asarray(rng.random((n, k)), jnp.float32)
    fused = MoeBackend("pallas", interpret=True, ffn_kernel_min_rows_per_expert=n * k // e)
    with jax.default_matmul_precision("highest"):
        got = routed_experts(x, weights, expert_ids, *w, backend=fused)
        small = routed_experts(x, weights, expert_ids, *w, backend=PALLAS)
        want = routed_experts(x, weights, expert_ids, *w, backend=REFERENCE)
        monkeypatch.setattr(moe_backend, "FFN_KERNEL_MAX_VMEM", 0)
        too_big = routed_experts(x, weights, expert_ids, *w, backend=fused)
    assert got.dtype == dtype
    assert _rel(got.astype(jnp.float32), want.astype(jnp.float32)) < (TOL if dtype == jnp.float32 else 2.0**-6)
    assert not np.array_equal(np.asarray(got), np.asarray(want))  # the kernel ran: its sums round differently
    np.testing.assert_array_equal(np.asarray(small), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(too_big), np.asarray(want))


def test_ffn_tile_rows_follow_the_rows_an_expert() -> None:
    """The large tile from ``min_rows_per_expert`` rows an expert, the small tile for 16 to 32 (a 64-request
    verify's 2,048 routed rows over 128 experts), ``ragged_dot`` (None) between and below."""
    from sglang_tpu_qwen.kernels.moe_backend import FFN_KERNEL_SMALL_TILE_ROWS, FFN_KERNEL_TILE_ROWS, ffn_tile_rows

    assert ffn_tile_rows(512, 128) is None  # 64 decode tokens x top-8: 4 rows an expert
    assert ffn_tile_rows(2048, 128) == ffn_tile_rows(4096, 128) == FFN_KERNEL_SMALL_TILE_ROWS
    assert ffn_tile_rows(2047, 128) is None and ffn_tile_rows(4097, 128) is None
    assert ffn_tile_rows(16384, 128) == FFN_KERNEL_TILE_ROWS
    assert ffn_tile_rows(512, 128, min_rows_per_expert=4) == FFN_KERNEL_TILE_ROWS


def test_pallas_runs_verify_sized_steps_with_the_small_tile(monkeypatch) -> None:
    """A step of 16 rows an expert under ``pallas`` runs grouped_ffn with the 32-row tile (seen by a wrapper on
    the kernel's entry): the reference's two products within the float32 tolerance."""
    from sglang_tpu_qwen.kernels.grouped_ffn import kernel as grouped_ffn_kernel
    from sglang_tpu_qwen.model.moe import routed_experts

    tiles = []
    run = grouped_ffn_kernel.grouped_ffn

    def counted(*args, tm, **kw):
        tiles.append(tm)
        return run(*args, tm=tm, **kw)

    monkeypatch.setattr(grouped_ffn_kernel, "grouped_ffn", counted)

    rng = np.random.default_rng(10)
    n, h, i, e, k = 48, 128, 64, 6, 2  # 96 routed rows over 6 experts: 16 an expert
    x = jnp.asarray(rng.standard_normal((n, h)), jnp.float32)
    w = [jnp.asarray(rng.standard_normal(s) * 0.1, jnp.float32) for s in ((e, h, i), (e, h, i), (e, i, h))]
    expert_ids = jnp.asarray(np.argsort(rng.random((n, e)), axis=1)[:, :k], jnp.int32)
    weights = jnp.asarray(rng.random((n, k)), jnp.float32)
    with jax.default_matmul_precision("highest"):
        got = routed_experts(x, weights, expert_ids, *w, backend=PALLAS)
        want = routed_experts(x, weights, expert_ids, *w, backend=REFERENCE)
    assert tiles == [32]
    assert _rel(got, want) < TOL
