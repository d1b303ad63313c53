"""Greedy ids of ``hidden @ lm_head^T`` in one pass over the lm_head, the logits never written to HBM.

Every greedy decode step, MTP draft and speculative verify step reads the whole ``[V, H]`` lm_head once (1.02 GB
on the 35B-A3B); XLA's fused product and argmax read it at 84-89% of the v5e's HBM peak at 1-64 rows and 76% at
256, where this kernel reads it at 90% at 1-64 rows and 86% at 256 (bench/lm_head.py, 2026-12-07: 1,377 against
1,488 us at 64 rows, 1,449 against 1,646 at 256). Each grid step multiplies the rows by a ``[tv, H]`` block of the
weight on the MXU (float32 accumulation) and folds the block's maximum and its lowest column into a running
maximum and id per row kept in the resident output blocks: ``jnp.argmax``'s answer (the first maximum; the first
NaN when a row has one), up to the float32 summation order of the products.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from sglang_tpu_qwen.utils.mxu_precision import operand_precision

ROW_TILE = 8  # rows are padded to a multiple of the float32 sublane tile
LANES = 128
# Vocabulary rows a grid step at up to BLOCK_ROWS hidden rows: 5 MiB of the 35B's bf16 lm_head, a divisor of the
# family's 248,320 (1,940 x 128). 1,280 and 2,560 ran alike at 1-64 rows on the v5e (bench/lm_head.py).
BLOCK_VOCAB = 1280
# More rows (a verify step's 4 tokens of 256 requests) shrink the block so that the [N, tv] float32 logits stay
# near 1.25 MiB of VMEM (2.5 MiB with the wide block below).
BLOCK_ROWS = 256
MIN_BLOCK_VOCAB = 256
# Over BLOCK_ROWS / 2 rows (a 64-request verify step's 256 positions) a block of twice BLOCK_VOCAB ran faster on the
# v5e: 1,449 against 1,478 us at 256 rows (bench/lm_head.py, 2026-12-07; 129 to 255 not measured), where 1 to 64
# rows ran alike. Taken where that weight block stays within WIDE_BLOCK_BYTES (the 35B's 10 MiB; the 397B's 20 MiB
# block is not).
WIDE_BLOCK_BYTES = 10 << 20


def block_vocab(rows: int, vocab: int, row_bytes: int) -> int:
    """Vocabulary rows a grid step for ``rows`` padded hidden rows and a weight of ``row_bytes`` bytes a
    vocabulary row: :data:`BLOCK_VOCAB`, doubled over ``BLOCK_ROWS / 2`` rows where the block stays within
    :data:`WIDE_BLOCK_BYTES`, shrunk past :data:`BLOCK_ROWS` rows to a multiple of 128 no smaller than
    :data:`MIN_BLOCK_VOCAB`; the whole vocabulary when it is smaller (a block may then take any size)."""
    if rows > BLOCK_ROWS:
        tv = max(MIN_BLOCK_VOCAB, BLOCK_VOCAB * BLOCK_ROWS // rows // LANES * LANES)
    elif rows > BLOCK_ROWS // 2 and 2 * BLOCK_VOCAB * row_bytes <= WIDE_BLOCK_BYTES:
        tv = 2 * BLOCK_VOCAB
    else:
        tv = BLOCK_VOCAB
    return vocab if vocab <= tv else tv


def _greedy_kernel(x_ref, w_ref, ids_ref, best_ref, *, tv: int, vocab: int) -> None:
    v = pl.program_id(0)
    logits = jax.lax.dot_general(x_ref[...], w_ref[...], (((1,), (1,)), ((), ())),
                                 precision=operand_precision(x_ref.dtype),
                                 preferred_element_type=jnp.float32)  # [rows, tv]
    col = jax.lax.broadcasted_iota(jnp.int32, logits.shape, 1)
    # The last block may run past the vocabulary: its rows there are stale VMEM, any value.
    logits = jnp.where(col + v * tv < vocab, logits, -jnp.inf)
    block_max = jnp.max(logits, axis=1, keepdims=True)  # NaN when the row has one
    hit = (logits == block_max) | jnp.isnan(logits)
    block_id = jnp.min(jnp.where(hit, col, tv), axis=1, keepdims=True) + v * tv
    lanes = ids_ref.shape
    block_max, block_id = jnp.broadcast_to(block_max, lanes), jnp.broadcast_to(block_id, lanes)

    @pl.when(v == 0)
    def _first():
        best_ref[...] = block_max
        ids_ref[...] = block_id

    @pl.when(v > 0)
    def _later():
        best = best_ref[...]
        # Strictly greater: an earlier block keeps a tie. A NaN wins over numbers and the first NaN stays.
        better = (block_max > best) | (jnp.isnan(block_max) & ~jnp.isnan(best))
        best_ref[...] = jnp.where(better, block_max, best)
        ids_ref[...] = jnp.where(better, block_id, ids_ref[...])


@functools.partial(jax.jit, static_argnames=("tv", "interpret"))
def greedy_lm_head(hidden: jax.Array, weight: jax.Array, *, tv: int | None = None,
                   interpret: bool = False) -> jax.Array:
    """Greedy ids of ``hidden @ weight^T`` (float32 accumulation) without writing the logits.

    Args:
        hidden: ``[N, H]`` (bfloat16 in serving), any N (padded to a multiple of 8 inside).
        weight: ``[V, H]`` lm_head (HF layout), the same dtype; any V.
        tv: vocabulary rows a grid step (a multiple of 128, or V); None: :func:`block_vocab`.
        interpret: Pallas TPU interpret mode (off a TPU).

    Returns:
        ``[N]`` int32: per row the lowest id of the largest float32 logit, or of the first NaN (``jnp.argmax``'s
        rule); a near-tie may resolve another way than XLA's product, whose float32 sums run in another order.

    Raises:
        ValueError: ``tv`` neither V nor a multiple of 128, or the two dtypes or hidden sizes differ.
    """
    n, h = hidden.shape
    vocab = weight.shape[0]
    if weight.shape[1] != h or weight.dtype != hidden.dtype:
        raise ValueError(f"hidden {hidden.shape} {hidden.dtype} and weight {weight.shape} {weight.dtype} differ")
    rows = -(-n // ROW_TILE) * ROW_TILE
    tv = tv or block_vocab(rows, vocab, h * weight.dtype.itemsize)
    if tv != vocab and tv % LANES:
        raise ValueError(f"tv {tv} must be the vocabulary size {vocab} or a multiple of {LANES}")
    x = jnp.pad(hidden, ((0, rows - n), (0, 0)))
    block_bytes = tv * h * weight.dtype.itemsize
    ids, _ = pl.pallas_call(
        functools.partial(_greedy_kernel, tv=tv, vocab=vocab),
        grid=(pl.cdiv(vocab, tv),),
        in_specs=[pl.BlockSpec((rows, h), lambda i: (0, 0)), pl.BlockSpec((tv, h), lambda i: (i, 0))],
        out_specs=[pl.BlockSpec((rows, LANES), lambda i: (0, 0)), pl.BlockSpec((rows, LANES), lambda i: (0, 0))],
        out_shape=[jax.ShapeDtypeStruct((rows, LANES), jnp.int32), jax.ShapeDtypeStruct((rows, LANES), jnp.float32)],
        # Two weight blocks, the rows, the [rows, tv] float32 logits and their temporaries (Mosaic's default scoped
        # VMEM is 16 MiB).
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("arbitrary",),
            vmem_limit_bytes=2 * block_bytes + 2 * rows * h * x.dtype.itemsize + 4 * rows * tv * 4 + (8 << 20)),
        cost_estimate=pl.CostEstimate(flops=2 * n * h * vocab, transcendentals=0,
                                      bytes_accessed=vocab * h * weight.dtype.itemsize + n * h * x.dtype.itemsize),
        interpret=pltpu.InterpretParams() if interpret else False,
    )(x, weight)
    return ids[:n, 0]
