"""Block-FP8 matmuls (quant/fp8.py weights, kernels/fp8_matmul, kernels/moe_backend.py): the Pallas grouped
matmul (interpret mode) and the XLA path equal dequantise-then-matmul, with partial edge blocks, empty groups,
row tiles shared by groups and rows past the groups; the MoE backend's two kinds agree; the model's forward
with FP8 weights through the Pallas kernel equals the forward on the dequantised weights.

Tolerance: float32 inputs; the kernel sums 128-row partial products in a different order than one dot
over the dequantised matrix, so results agree to ~1e-6 relative; we allow 1e-5 of the largest magnitude.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from sglang_tpu_qwen.kernels.fp8_matmul.kernel import (
    _cost,
    fp8_grouped_matmul,
    fp8_grouped_matmul_scatter_add,
    fp8_grouped_swiglu,
    linear_tiles,
)
from sglang_tpu_qwen.kernels.fp8_matmul.reference import (
    dequantize_blocks,
    fp8_grouped_matmul_reference,
    fp8_grouped_matmul_scatter_add_reference,
    fp8_grouped_swiglu_reference,
)
from sglang_tpu_qwen.kernels.moe_backend import MoeBackend
from sglang_tpu_qwen.quant import fp8

TOL = 1e-5
REFERENCE, PALLAS = MoeBackend("reference"), MoeBackend("pallas", interpret=True)  # interpret: on CPU


def _rel(got: jax.Array, want: jax.Array) -> float:
    return float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))


def _weights(rng: np.random.Generator, g: int, k: int, n: int, block: tuple[int, int]) -> fp8.Fp8Weight:
    q = jnp.asarray(rng.standard_normal((g, k, n)), jnp.float32).astype(jnp.float8_e4m3fn)
    scale = rng.uniform(0.25, 4.0, (g, -(-k // block[0]), -(-n // block[1]))).astype(np.float32)
    return fp8.Fp8Weight(q=q, scale=jnp.asarray(scale), block=block)


@pytest.mark.parametrize(
    "m,k,n,sizes,tiles",
    [
        # Partial blocks on both sides (300 = 2 x 128 + 44, 200 = 128 + 72); small tiles: the 16-row tiles
        # are shared by groups, one group is empty, 8 rows follow the last group.
        (40, 300, 200, [7, 0, 20, 5], dict(tm=16, tk=128, tn=128)),
        # Default tiles: one K tile, one N tile, every group in the first row tile.
        (40, 300, 200, [7, 0, 20, 5], {}),
        # Two K tiles and two N tiles of several blocks each.
        (24, 520, 300, [10, 14], dict(tk=256, tn=256)),
        # No rows at all for any group: the output is all zeros.
        (16, 128, 128, [0, 0], {}),
    ],
)
def test_kernel_matches_dequantised_ragged_dot(m, k, n, sizes, tiles):
    rng = np.random.default_rng(m + k + n)
    w = _weights(rng, len(sizes), k, n, (128, 128))
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    gs = jnp.asarray(sizes, jnp.int32)
    got = fp8_grouped_matmul(x, w.q, w.scale, gs, block=w.block, interpret=True, **tiles)
    want = fp8_grouped_matmul_reference(x, w.q, w.scale, gs, w.block)
    assert np.all(np.asarray(got)[sum(sizes):] == 0)
    if sum(sizes):
        err = _rel(got, want)
        print(f"kernel vs dequantised ragged_dot {m}x{k}x{n} groups {sizes}: rel err {err:.1e}")
        assert err < TOL


@pytest.mark.parametrize("row_scale", [False, True])
@pytest.mark.parametrize(
    "m,k,n,sizes,tiles",
    [
        # Shared 16-row tiles, an empty group, rows past the groups, partial blocks on both sides.
        (40, 300, 200, [7, 0, 20, 5], dict(tm=16, tk=128, tn=128)),
        # Two K tiles and two N tiles: both accumulators live across K tiles, the epilogue runs per N tile.
        (24, 520, 300, [10, 14], dict(tk=256, tn=256)),
    ],
)
def test_swiglu_kernel_matches_reference(m, k, n, sizes, tiles, row_scale):
    """Gate and up in one pass with SwiGLU (and the routing weight) in the epilogue equal silu(gate) * up of
    the dequantised products; rows past the groups are 0."""
    rng = np.random.default_rng(m + k + n + row_scale)
    wg, wu = _weights(rng, len(sizes), k, n, (128, 128)), _weights(rng, len(sizes), k, n, (128, 128))
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    gs = jnp.asarray(sizes, jnp.int32)
    rs = jnp.asarray(rng.uniform(0.1, 1.0, m), jnp.float32) if row_scale else None
    got = fp8_grouped_swiglu(x, wg.q, wg.scale, wu.q, wu.scale, gs, None, rs, block=(128, 128), interpret=True,
                             **tiles)
    want = fp8_grouped_swiglu_reference(x, wg.q, wg.scale, wu.q, wu.scale, gs, (128, 128), rs)
    assert np.all(np.asarray(got)[sum(sizes):] == 0)
    err = _rel(got, want)
    print(f"swiglu kernel vs reference {m}x{k}x{n} groups {sizes} row scale {row_scale}: rel err {err:.1e}")
    assert err < TOL
    # The fused pass is the unfused one: silu(gate) * up from two single-weight kernel calls.
    gate = fp8_grouped_matmul(x, wg.q, wg.scale, gs, block=(128, 128), interpret=True, **tiles)
    up = fp8_grouped_matmul(x, wu.q, wu.scale, gs, block=(128, 128), interpret=True, **tiles)
    unfused = jax.nn.silu(gate) * up * (1.0 if rs is None else rs[:, None])
    assert _rel(got, unfused) < TOL


def _destinations(rng: np.random.Generator, sizes: list[int], m: int, r: int) -> jax.Array:
    """Each group's rows go to distinct accumulator rows (a token once per expert); rows of different groups
    share destinations (a token routed to several experts); rows past the groups point anywhere."""
    dest = [int(d) for s in sizes for d in rng.choice(r, s, replace=False)]
    return jnp.asarray(dest + list(rng.integers(0, r, m - len(dest))), jnp.int32)


@pytest.mark.parametrize("overwrite", [False, True], ids=["add", "overwrite_first"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize(
    "m,k,n,r,sizes,tiles",
    [
        # Shared 16-row tiles, an empty group, rows past the groups, partial K blocks, two K tiles; 24
        # accumulator rows for 32 covered rows: rows receive up to three products.
        (40, 300, 256, 24, [7, 0, 20, 5], dict(tm=16, tk=128)),
        # Default tiles: every group in one row tile, one K tile.
        (24, 200, 384, 30, [10, 14], {}),
    ],
)
def test_scatter_add_kernel_matches_reference(m, k, n, r, sizes, tiles, dtype, overwrite):
    """The down projection with the MoE combine fused: ``acc[dest[r]] += x[r] @ w`` row by row in HBM equals
    the reference's sequential scatter-add (bitwise in float32 up to the product's rounding; one bfloat16
    rounding per add in bfloat16), rows no group covers are untouched. With ``overwrite`` on each
    destination's first row (the MoE's use: that row is still zero), those rows start as NaN: a read of one
    would leak into the sum."""
    rng = np.random.default_rng(m + k + n + r)
    w = _weights(rng, len(sizes), k, n, (128, 128))
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    gs = jnp.asarray(sizes, jnp.int32)
    dest = _destinations(rng, sizes, m, r)
    acc = jnp.asarray(rng.standard_normal((r + 3, n // 128, 128)), dtype)  # 3 rows no group points to
    touched, first = np.unique(np.asarray(dest)[: sum(sizes)], return_index=True)
    flags = None
    if overwrite:
        flags = jnp.zeros(m, bool).at[first].set(True)
        acc = acc.at[touched].set(jnp.nan)
    want = fp8_grouped_matmul_scatter_add_reference(x, w.q, w.scale, gs, dest, acc, w.block, flags)
    assert np.all(np.isfinite(np.asarray(want, np.float32)[touched]))
    # DMAs executed only when waited for: a read issued before the previous visit's write of the same row
    # was waited for, or a write never waited for, shows as a wrong sum.
    on_wait = pltpu.InterpretParams(dma_execution_mode="on_wait", detect_races=True)
    got = fp8_grouped_matmul_scatter_add(x, w.q, w.scale, gs, dest, jnp.array(acc), overwrite=flags, block=w.block,
                                         interpret=on_wait, **tiles)
    untouched = np.setdiff1d(np.arange(r + 3), touched)
    assert np.array_equal(np.asarray(got)[untouched], np.asarray(acc)[untouched])
    assert np.all(np.isfinite(np.asarray(got, np.float32)[touched]))
    err = _rel(got.astype(jnp.float32), want.astype(jnp.float32))
    print(f"scatter-add kernel vs reference {m}x{k}x{n} -> {r} rows, {np.dtype(dtype).name}: rel err {err:.1e}")
    assert err < (TOL if dtype == jnp.float32 else 2**-7)
    with pytest.raises(ValueError, match="multiple of 128"):
        fp8_grouped_matmul_scatter_add(x, w.q, w.scale, gs, dest, acc.reshape(r + 3, -1), block=w.block)


@pytest.mark.parametrize(
    "m,k,n,r,sizes,tiles",
    [(40, 300, 256, 24, [7, 0, 20, 5], dict(tm=16, tk=128)), (24, 200, 384, 30, [10, 14], {})],
)
def test_scatter_add_kernel_into_a_new_accumulator(m, k, n, r, sizes, tiles):
    """``acc=None``: the kernel's output is a fresh buffer nothing zeroes (interpreted with uninitialised
    memory as NaN); each destination's first row overwrites, ``zero_rows`` (the rows no product touches, in
    random order with -1 padding) are zeroed: the result equals the scatter-add into zeros, every row defined."""
    rng = np.random.default_rng(m + k + n + r + 1)
    w = _weights(rng, len(sizes), k, n, (128, 128))
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    gs = jnp.asarray(sizes, jnp.int32)
    dest = _destinations(rng, sizes, m, r)
    rows = r + 3
    touched, first = np.unique(np.asarray(dest)[: sum(sizes)], return_index=True)
    flags = jnp.zeros(m, bool).at[first].set(True)
    untouched = rng.permutation(np.setdiff1d(np.arange(rows), touched))
    zero_rows = jnp.asarray(np.concatenate([untouched, [-1, -1]]), jnp.int32)
    zeros = jnp.zeros((rows, n // 128, 128), jnp.bfloat16)
    want = fp8_grouped_matmul_scatter_add_reference(x, w.q, w.scale, gs, dest, zeros, w.block)
    params = pltpu.InterpretParams(dma_execution_mode="on_wait", detect_races=True, uninitialized_memory="nan")
    got = fp8_grouped_matmul_scatter_add(x, w.q, w.scale, gs, dest, None, overwrite=flags, zero_rows=zero_rows,
                                         num_rows=rows, block=w.block, interpret=params, **tiles)
    assert got.shape == want.shape and got.dtype == jnp.bfloat16
    assert np.all(np.isfinite(np.asarray(got, np.float32)))
    assert np.all(np.asarray(got, np.float32)[untouched] == 0)
    assert _rel(got.astype(jnp.float32), want.astype(jnp.float32)) < 2**-7
    with pytest.raises(ValueError, match="num_rows"):
        fp8_grouped_matmul_scatter_add(x, w.q, w.scale, gs, dest, None, block=w.block)


@pytest.mark.parametrize(
    "m,k,n,s,sizes,tiles",
    [
        # Shared 16-row tiles, an empty group, rows past the groups, two N tiles (the prefetch crosses from
        # the last visit of one N tile to the first of the next).
        (40, 256, 256, 50, [7, 0, 20, 5], dict(tm=16, tn=128)),
        # Default tiles: every group in one row tile.
        (24, 384, 200, 30, [10, 14], {}),
    ],
)
def test_swiglu_kernel_gathers_its_rows(m, k, n, s, sizes, tiles):
    """With row ids the kernel reads each row from the [S, K / 128, 128] source by DMA, double-buffered
    across visits; the result equals the kernel on the rows gathered beforehand, bitwise (interpreted with
    DMAs executed only at their wait, so a wait missing or out of order fails)."""
    rng = np.random.default_rng(m + k + n + s)
    wg, wu = _weights(rng, len(sizes), k, n, (128, 128)), _weights(rng, len(sizes), k, n, (128, 128))
    src = jnp.asarray(rng.standard_normal((s, k)), jnp.float32)
    ids = jnp.asarray(rng.integers(0, s, m), jnp.int32)  # repeats allowed: a token of several experts
    gs = jnp.asarray(sizes, jnp.int32)
    rs = jnp.asarray(rng.uniform(0.1, 1.0, m), jnp.float32)
    on_wait = pltpu.InterpretParams(dma_execution_mode="on_wait", detect_races=True)
    got = fp8_grouped_swiglu(src.reshape(s, k // 128, 128), wg.q, wg.scale, wu.q, wu.scale, gs, None, rs, ids,
                             block=(128, 128), interpret=on_wait, **tiles)
    want = fp8_grouped_swiglu(src[ids], wg.q, wg.scale, wu.q, wu.scale, gs, None, rs, block=(128, 128),
                              interpret=True, tk=k, **tiles)
    covered = sum(sizes)
    np.testing.assert_array_equal(np.asarray(got)[:covered], np.asarray(want)[:covered])
    assert np.all(np.asarray(got)[covered:] == 0)
    ref = fp8_grouped_swiglu_reference(src[ids], wg.q, wg.scale, wu.q, wu.scale, gs, (128, 128), rs)
    assert _rel(got, ref) < TOL
    # The reference backend's XLA path (kernels/moe_backend.py) gathers the same rows from the same source.
    w_gate, w_up = wg, wu
    xla = REFERENCE.grouped_swiglu(src.reshape(s, k // 128, 128), w_gate, w_up, gs, rs, row_ids=ids)
    assert _rel(xla[:covered], ref[:covered]) < TOL


def test_kernel_reads_one_layer_of_a_stack():
    """A stacked ``q [L, G, K, N]`` with a traced layer index reads that layer (the forward's scan)."""
    rng = np.random.default_rng(7)
    ws = [_weights(rng, 2, 300, 136, (128, 128)) for _ in range(3)]
    stack = jnp.stack([w.q for w in ws])
    x = jnp.asarray(rng.standard_normal((20, 300)), jnp.float32)
    gs = jnp.asarray([12, 8], jnp.int32)
    run = jax.jit(functools.partial(fp8_grouped_matmul, block=(128, 128), interpret=True))
    for layer in (0, 2):
        got = run(x, stack, ws[layer].scale, gs, jnp.int32(layer))
        want = fp8_grouped_matmul_reference(x, ws[layer].q, ws[layer].scale, gs, (128, 128))
        assert _rel(got, want) < TOL


def test_xla_path_and_linear():
    """Under the reference backend ``grouped``/``linear`` dequantise in XLA: equal to the dense matmul of the
    dequantised weight; ``linear`` through the kernel (the pallas backend, interpret) too, with leading batch
    dims."""
    rng = np.random.default_rng(1)
    w = _weights(rng, 3, 200, 136, (128, 128))
    x = jnp.asarray(rng.standard_normal((30, 200)), jnp.float32)
    gs = jnp.asarray([10, 0, 15], jnp.int32)
    with jax.default_matmul_precision("highest"):
        want = fp8_grouped_matmul_reference(x, w.q, w.scale, gs, w.block)
        assert _rel(jax.jit(REFERENCE.grouped)(x, w, gs), want) < TOL
        one = fp8.Fp8Weight(q=w.q[1], scale=w.scale[1], block=w.block)
        xb = x.reshape(5, 6, 200)
        dense = xb @ dequantize_blocks(one.q, one.scale, one.block, jnp.float32)
        assert _rel(jax.jit(REFERENCE.linear)(xb, one), dense) < TOL
        assert _rel(jax.jit(PALLAS.linear)(xb, one), dense) < TOL


def test_linear_tiles_read_each_weight_once():
    """A 1024-token prefill projection takes one row tile (its weight streamed once: 128-row tiles with
    512-deep K tiles streamed it once per row tile, 8 times), and the kernel declares that traffic; a decode
    step keeps the default tiles, already at one weight read. One row tile of 256 rows through ``linear``
    (interpret) equals the dense product."""
    m, k, n = 1024, 2048, 8192
    t = linear_tiles(m, k, n)
    assert t["tm"] == m

    def declared(tiles: dict[str, int]) -> float:  # the pl.CostEstimate the kernel hands XLA
        return _cost(m, k, n, 1, 2, tiles["tm"], None, tiles_n=-(-n // tiles["tn"]),
                     tiles_k=-(-k // tiles["tk"])).bytes_accessed

    own_min = k * n + 2 * m * k + 2 * m * n  # FP8 weight once, bf16 x read once, bf16 product written once
    assert own_min <= declared(t) <= 1.01 * own_min
    # The default 128-row tiles stream the weight once per row tile (what the kernel really moves).
    assert declared({"tm": 128, "tk": 512, "tn": 4096}) > 7 * k * n
    assert linear_tiles(8, 4096, 12288) == {"tm": 16, "tk": 512, "tn": 6144}

    rng = np.random.default_rng(3)
    w = _weights(rng, 1, 1024, 256, (128, 128))
    one = fp8.Fp8Weight(q=w.q[0], scale=w.scale[0], block=w.block)
    xs = jnp.asarray(rng.standard_normal((256, 1024)), jnp.float32)
    assert linear_tiles(256, 1024, 256, 4)["tm"] == 256  # the default: two 512-deep K tiles, 2 weight reads
    dense = xs @ dequantize_blocks(w.q[0], w.scale[0], w.block, jnp.float32)
    assert _rel(jax.jit(PALLAS.linear)(xs, one), dense) < TOL


def test_quantize_partial_blocks():
    """``quantize`` handles partial edge blocks: scale ``[..., ceil(R/b0), ceil(C/b1)]``, and the
    dequantised matrix is within e4m3's 3-bit mantissa (<4% Frobenius) of the original."""
    w = jax.random.normal(jax.random.key(0), (2, 300, 200), jnp.float32)
    q = fp8.quantize(w)
    assert q.q.shape == (2, 300, 200) and q.scale.shape == (2, 3, 2) and q.q.dtype == jnp.float8_e4m3fn
    err = float(jnp.linalg.norm(fp8.dequantize(q, jnp.float32) - w) / jnp.linalg.norm(w))
    assert err < 0.04


def test_fp8_forward_through_kernel_is_the_model():
    """``forward_step`` with FP8 weights and every FP8 matmul in the Pallas kernel (the pallas MoE backend,
    interpret mode) equals ``forward_step`` on the dequantised weights (a prefill step of two rows, one of them
    padded)."""
    from sglang_tpu_qwen.embedded.checkpoint import embedded_config_dict, init_embedded_params
    from sglang_tpu_qwen.kernels.dispatch import KernelBackends
    from sglang_tpu_qwen.model.config import Qwen35MoeConfig
    from sglang_tpu_qwen.model.forward import forward_step, init_cache
    from sglang_tpu_qwen.model.forward_batch import ForwardBatch

    d = embedded_config_dict()
    # Odd widths: partial 128-blocks in every quantised matrix.
    d["text_config"].update(vocab_size=512, hidden_size=200, moe_intermediate_size=72,
                            shared_expert_intermediate_size=136)
    config = Qwen35MoeConfig.from_hf_dict(d)
    params = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), init_embedded_params(config))
    q = fp8.quantize_params(params)
    assert isinstance(q["layers"][0]["moe"]["w_gate"], fp8.Fp8Weight)
    assert q["layers"][3]["attn"]["q_proj"].scale.shape[-2:] == (2, 8)  # 200 rows, 1024 columns (4 heads x 128 x 2)
    deq = fp8.dequantize_tree(q, jnp.float32)
    b, t = 2, 5
    args = (np.arange(1, b * t + 1, dtype=np.int32).reshape(b, t), np.zeros(b, np.int32), np.array([5, 3], np.int32),
            np.array([[1, 2], [3, 4]], np.int32), np.array([1, 2], np.int32))
    fwd = functools.partial(forward_step, config=config)
    with jax.default_matmul_precision("highest"):
        ref, _ = jax.jit(fwd)(deq, init_cache(config, 8, 4, 4, jnp.float32), ForwardBatch.of(*args))
        on_kernel = functools.partial(fwd, backends=KernelBackends(moe=PALLAS))
        got, _ = jax.jit(on_kernel)(q, init_cache(config, 8, 4, 4, jnp.float32), ForwardBatch.of(*args))
    valid = np.arange(t)[None, :] < args[2][:, None]
    err = _rel(jnp.asarray(np.asarray(got)[valid]), jnp.asarray(np.asarray(ref)[valid]))
    print(f"FP8 forward through the kernel vs dequantised weights: rel err {err:.1e}")
    assert err < TOL
