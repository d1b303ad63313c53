"""Ragged paged attention: the Pallas kernel in interpret mode (CPU) against the model's jnp reference.

The kernel reads head-major pools (kernels/ragged_paged_attention/head_major.py); the reference runs on the
same values stored token-major (its default), so the comparison also checks the kernel's block writes (a sublane
tile of tokens, or the page where the tile does not divide it) against the reference's per-token ones through the
two layouts' logical views.

Seeded ragged batches over a paged cache with shuffled page tables: only decodes, only prefills, mixed
decodes + prefill chunks with and without a cached prefix, contexts crossing page boundaries, padding rows
(zero-length context), head_dim 128 and 256, and the largest bucket the test affords. Small head counts and
pages keep interpret mode fast. Tolerances (max abs error on valid rows, values O(1)): fp32 2e-5,
bf16 3e-2 (bf16 probabilities times bf16 values, summed in fp32). The caches must match exactly on every
page but trash page 0 (the reference writes padded tokens there, the kernel skips them).

FP8 pages (kernels/ragged_paged_attention/kv_quant.py): the kernel on a float8_e4m3fn cache with per-layer
scales against the reference on float32 pages holding the dequantised values (q * scale, and the new K/V
quantised and dequantised alike), so the kernel's FP8 read and scale placement are checked against plain
float32 attention, and its FP8 writes against the reference's FP8 writes, byte for byte.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sglang_tpu_qwen.kernels.ragged_paged_attention.block_sizes import BlockSizes
from sglang_tpu_qwen.kernels.ragged_paged_attention.head_major import HEAD_MAJOR
from sglang_tpu_qwen.kernels.ragged_paged_attention.kernel import ragged_paged_attention, write_block_rows
from sglang_tpu_qwen.kernels.ragged_paged_attention.kv_quant import FP8_KV_DTYPE, dequantize_kv, quantize_kv
from sglang_tpu_qwen.kernels.ragged_paged_attention.reference import ragged_paged_attention_reference
from sglang_tpu_qwen.kernels.ragged_paged_attention.token_major import TOKEN_MAJOR

TOL = {jnp.float32: 2e-5, jnp.bfloat16: 3e-2}
# Small blocks so a row crosses several key blocks and a decode grid step holds several rows; steps of more than
# 8 query rows a row (4 tokens at G = 2) take the one-row-a-grid-step path.
BLOCKS = BlockSizes(decode_seqs=4, short_q_rows=8, prefill_q=8, block_keys=16)


def _batch(rng, prefix_lens, q_lens, t, *, nq=4, nkv=2, hd=128, page_size=8, layers=2, dtype=jnp.float32):
    """Random queries, new K/V and a random cache; each row's pages drawn from a shuffled pool (never 0)."""
    prefix_lens, q_lens = np.asarray(prefix_lens, np.int32), np.asarray(q_lens, np.int32)
    kv_lens = prefix_lens + q_lens
    need = -(-kv_lens // page_size)
    cols = max(1, int(need.max()))
    num_pages = int(need.sum()) + 3
    pool = iter(rng.permutation(np.arange(1, num_pages)))  # out-of-order pages
    page_table = np.zeros((len(q_lens), cols), np.int32)
    for b, n in enumerate(need):
        page_table[b, :n] = [next(pool) for _ in range(n)]
    b = len(q_lens)

    def arr(*shape):
        return jnp.asarray(rng.standard_normal(shape), dtype)

    return dict(q=arr(b, t, nq, hd), k_new=arr(b, t, nkv, hd), v_new=arr(b, t, nkv, hd),
                k_cache=arr(layers, num_pages, page_size, nkv, hd), v_cache=arr(layers, num_pages, page_size, nkv, hd),
                layer=layers - 1, q_lens=jnp.asarray(q_lens), kv_lens=jnp.asarray(kv_lens),
                page_table=jnp.asarray(page_table))


def _head_major(inputs):
    """The inputs with the (logical, token-major) pools stored head-major, as the kernel reads them."""
    return {k: HEAD_MAJOR.stored(v) if k in ("k_cache", "v_cache") else v for k, v in inputs.items()}


def _check(inputs, dtype, block_sizes=BLOCKS):
    out_r, k_r, v_r = ragged_paged_attention_reference(**inputs)
    out_k, k_k, v_k = ragged_paged_attention(**_head_major(inputs), block_sizes=block_sizes, interpret=True)
    k_k, v_k = HEAD_MAJOR.logical(k_k, 0), HEAD_MAJOR.logical(v_k, 0)
    q_lens = np.asarray(inputs["q_lens"])
    valid = np.arange(inputs["q"].shape[1])[None, :] < q_lens[:, None]
    err = np.abs(np.asarray(out_k, np.float32) - np.asarray(out_r, np.float32))[valid]
    assert np.all(np.isfinite(np.asarray(out_k, np.float32)))
    assert err.max() <= TOL[dtype], f"max abs error {err.max()}"
    np.testing.assert_array_equal(np.asarray(k_k)[:, 1:], np.asarray(k_r)[:, 1:])
    np.testing.assert_array_equal(np.asarray(v_k)[:, 1:], np.asarray(v_r)[:, 1:])
    # A padding row (q_len 0) gets zeros.
    assert np.all(np.asarray(out_k)[q_lens == 0] == 0)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_only_decodes(dtype) -> None:
    rng = np.random.default_rng(1)
    # Contexts ending exactly on, just past and well past page boundaries; one padding row (empty context).
    prefix = [7, 8, 15, 0, 30, 2, 16, 0]
    q_lens = [1, 1, 1, 1, 1, 1, 1, 0]
    _check(_batch(rng, prefix, q_lens, 1, dtype=dtype), dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_only_prefills(dtype) -> None:
    rng = np.random.default_rng(2)
    _check(_batch(rng, [0, 0, 0], [32, 19, 8], 32, dtype=dtype), dtype)


@pytest.mark.parametrize("hd", [128, 256])
def test_mixed_decodes_and_prefill_chunks(hd: int) -> None:
    rng = np.random.default_rng(3)
    # decode, chunk with a cached prefix crossing pages, fresh prefill, padding row, prefix-only-ish chunk
    prefix = [13, 9, 0, 0, 21]
    q_lens = [1, 16, 7, 0, 3]
    _check(_batch(rng, prefix, q_lens, 16, hd=hd), jnp.float32)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_short_steps_many_rows_a_grid_step(dtype) -> None:
    """An MTP verify's shape: 4 tokens a row (8 query rows at G = 2), 2 rows a grid step (decode_seqs 8 / T 4).
    Contexts end on, just past and mid a key block, so blocks overhang the rows' last pages (those pages are not
    fetched); a row feeds fewer tokens than T; padding rows open a grid step and sit between rows with keys."""
    rng = np.random.default_rng(7)
    prefix = [0, 12, 5, 0, 27, 16, 0, 3]
    q_lens = [0, 4, 4, 2, 4, 1, 0, 3]
    _check(_batch(rng, prefix, q_lens, 4, dtype=dtype), dtype,
           BlockSizes(decode_seqs=8, short_q_rows=8, prefill_q=8, block_keys=16))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_writes_blocks_smaller_than_pages(dtype) -> None:
    """Pages of 32 tokens written a sublane tile at a time (8 float32 / 16 bf16 rows: 4 / 2 blocks a page):
    decode rows on, just past and mid a block, chunks crossing blocks and a page (28 + 9, 56 + 13), a padding
    row."""
    assert write_block_rows(32, dtype) < 32
    rng = np.random.default_rng(8)
    prefix = [31, 32, 7, 0, 28, 56, 16, 0]
    q_lens = [1, 1, 1, 9, 9, 13, 1, 0]
    _check(_batch(rng, prefix, q_lens, 16, page_size=32, dtype=dtype), dtype,
           BlockSizes(decode_seqs=4, short_q_rows=8, prefill_q=8, block_keys=64))
    _check(_batch(rng, prefix, [1] * 7 + [0], 1, page_size=32, dtype=dtype), dtype)


def test_gqa_ratio_and_largest_bucket() -> None:
    """Eight query heads per KV head, 64-token bucket over many pages, default-ish blocks."""
    rng = np.random.default_rng(4)
    inputs = _batch(rng, [40, 0, 100], [64, 64, 33], 64, nq=8, nkv=1, page_size=16)
    _check(inputs, jnp.float32, BlockSizes(decode_seqs=8, prefill_q=32, block_keys=64))


def test_layer_index_selects_only_that_layer() -> None:
    rng = np.random.default_rng(5)
    inputs = _batch(rng, [5, 0], [3, 4], 4, layers=3)
    inputs["layer"] = jnp.int32(1)
    before = np.asarray(inputs["k_cache"]).copy()
    _, k_k, _ = ragged_paged_attention(**_head_major(inputs), block_sizes=BLOCKS, interpret=True)
    k_k = np.asarray(HEAD_MAJOR.logical(k_k, 0))
    np.testing.assert_array_equal(k_k[0], before[0])
    np.testing.assert_array_equal(k_k[2], before[2])
    assert not np.array_equal(k_k[1], before[1])
    _check(inputs, jnp.float32)


def test_rejects_bad_head_ratio() -> None:
    rng = np.random.default_rng(6)
    inputs = _batch(rng, [0], [2], 2, nq=3, nkv=2)
    with pytest.raises(ValueError, match="multiple"):
        jax.eval_shape(lambda: ragged_paged_attention(**_head_major(inputs), interpret=True))


def test_rejects_token_major_pools() -> None:
    inputs = _batch(np.random.default_rng(6), [0], [2], 2)
    with pytest.raises(ValueError, match="head-major"):
        jax.eval_shape(lambda: ragged_paged_attention(**inputs, interpret=True))


@pytest.mark.parametrize(("nkv", "page_size"), [(2, 8), (1, 8), (2, 64)])
def test_fp8_pages_match_reference_on_dequantised_pages(nkv: int, page_size: int) -> None:
    """One small mixed step (a decode row, a chunk over a prefix crossing pages, a fresh chunk, a padding row):
    interpret mode costs seconds per grid step on 2 cores, so the decode-only grid form (several rows per grid
    step, the same per-row code) is left to the Ironwood compile test. Pages of 8 are written whole; pages of 64
    a 32-token block at a time (the chunk at 30 crosses blocks)."""
    t, prefix, q_lens = 8, [13, 9 if page_size == 8 else 30, 0, 0], [1, 8, 5, 0]
    rng = np.random.default_rng(7)
    inputs = _batch(rng, prefix, q_lens, t, nkv=nkv, hd=128, page_size=page_size)
    # Scales away from 1 and not powers of two, K and V different: a swapped or missing scale shows.
    k_scale, v_scale = jnp.float32(0.37), jnp.float32(2.9)
    # The kernel's head-major FP8 pools (no packing: the page is the second-minor dim).
    k8 = HEAD_MAJOR.stored(quantize_kv(inputs["k_cache"] * 40.0, FP8_KV_DTYPE, k_scale))  # spread over e4m3's range
    v8 = HEAD_MAJOR.stored(quantize_kv(inputs["v_cache"], FP8_KV_DTYPE, v_scale))
    assert k8.shape[2:] == (nkv, inputs["k_cache"].shape[2], 128)
    with pytest.raises(ValueError, match="page size 6 must be a multiple of 4"):
        TOKEN_MAJOR.pool_shape(1, 1, 6, 1, 128, FP8_KV_DTYPE)
    assert TOKEN_MAJOR.pool_shape(1, 1, 6, 1, 128, jnp.bfloat16) == (1, 1, 6, 1, 128)  # other dtypes: unpacked
    k_new, v_new = inputs["k_new"] * 40.0, inputs["v_new"]
    out_k, kc_k, vc_k = ragged_paged_attention(**{**inputs, "k_new": k_new, "v_new": v_new,  # donates its caches
                                                  "k_cache": jnp.array(k8, copy=True),
                                                  "v_cache": jnp.array(v8, copy=True)}, k_scale=k_scale,
                                               v_scale=v_scale,
                                               block_sizes=BLOCKS, interpret=True)
    assert kc_k.dtype == vc_k.dtype == FP8_KV_DTYPE
    # Reference 1: the same FP8 caches through the jnp reference (the writes must agree byte for byte).
    ref = jax.jit(ragged_paged_attention_reference, static_argnames="layout")
    _, kc_r, vc_r = ref(**{**inputs, "k_new": k_new, "v_new": v_new, "k_cache": k8, "v_cache": v8},
                        k_scale=k_scale, v_scale=v_scale, layout=HEAD_MAJOR)
    np.testing.assert_array_equal(np.asarray(kc_k)[:, 1:].view(np.uint8), np.asarray(kc_r)[:, 1:].view(np.uint8))
    np.testing.assert_array_equal(np.asarray(vc_k)[:, 1:].view(np.uint8), np.asarray(vc_r)[:, 1:].view(np.uint8))
    # Reference 2: float32 attention on the dequantised pages and new K/V.
    def dq(x, scale):
        return dequantize_kv(quantize_kv(x, FP8_KV_DTYPE, scale), scale)

    out_r, _, _ = ref(
        **{**inputs, "k_new": dq(k_new, k_scale), "v_new": dq(v_new, v_scale),
           "k_cache": dequantize_kv(HEAD_MAJOR.logical(k8, nkv), k_scale),
           "v_cache": dequantize_kv(HEAD_MAJOR.logical(v8, nkv), v_scale)})
    valid = np.arange(t)[None, :] < np.asarray(q_lens)[:, None]
    err = np.abs(np.asarray(out_k) - np.asarray(out_r))[valid]
    assert np.all(np.isfinite(np.asarray(out_k)))
    print(f"fp8 pages vs float32 on dequantised pages: max abs error {err.max():.2e}")
    assert err.max() <= 1e-4, f"max abs error {err.max()}"
    assert np.all(np.asarray(out_k)[np.asarray(q_lens) == 0] == 0)


def test_fp8_writes_saturate_instead_of_overflowing() -> None:
    x = jnp.asarray([1e6, -1e6, 448.0, 0.5], jnp.float32)
    q = quantize_kv(x, FP8_KV_DTYPE, 1.0)
    assert np.asarray(q, np.float32).tolist() == [448.0, -448.0, 448.0, 0.5]  # no NaN from e4m3fn overflow
