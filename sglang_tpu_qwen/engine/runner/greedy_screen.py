"""Greedy decoding with a float32 lm_head read mostly in bfloat16, with an exact certificate.

Used by the greedy sampling program (engine/runner/model_runner.py) when the lm_head is float32 (`--dtype auto`
on CPU): greedy decode at a small batch reads the whole lm_head every step, and on XLA:CPU that read is
the largest cost of a decode step; a bfloat16 screen halves it without changing a token.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from sglang_tpu_qwen.engine.runner.sampler import NEG_INF, greedy_ids, vocab_blocks
from sglang_tpu_qwen.utils.host_allocator import host_memory_kept

# Vocabulary ids per screened block. Smaller blocks mean fewer float32 candidates to gather per row
# (SCREEN_BLOCKS * SCREEN_BLOCK): measured on the 2-core CPU with the host allocator's settings, 128 rows
# 31.4 -> 27.3 ms at 64 instead of 128 ids, and the certificate held as often (83 of 84 steps of a 128-prompt
# run at 32, 64 and 128 ids; with 2 blocks of 64 only 41 of 84).
SCREEN_BLOCK = 64
SCREEN_BLOCKS = 4  # vocabulary blocks whose float32 logits screened_greedy computes
SCREEN_ROWS = 32  # rows per bfloat16 product of screened_greedy (glibc's default allocator)
SCREEN_ROWS_KEPT_MEMORY = 128  # the same with host_allocator's settings (SGLANG_TPU_QWEN_KEEP_HOST_MEMORY=1)


class GreedyScreen(NamedTuple):
    """A bfloat16 screen of a float32 lm_head for `screened_greedy` (built once by `greedy_screen`).

    weight: [V, H] bfloat16, the lm_head rounded. Per block of SCREEN_BLOCK ids ([ceil(V / SCREEN_BLOCK)]
    float32): residual_norm, the largest ||lm_head[v] - weight[v]||_2 of the block; norm, the largest
    ||weight[v]||_2.
    """

    weight: jax.Array
    residual_norm: jax.Array
    norm: jax.Array


def greedy_screen(weight: jax.Array) -> GreedyScreen:
    """The screen of a float32 lm_head weight [V, H] (HF layout). Jit it: it reads the weight once."""
    rounded = weight.astype(jnp.bfloat16)

    def block_max(x: jax.Array) -> jax.Array:  # [V] -> [ceil(V / SCREEN_BLOCK)]
        return jnp.max(vocab_blocks(x, 0.0, SCREEN_BLOCK), axis=-1)

    residual = jnp.linalg.norm(weight - rounded.astype(jnp.float32), axis=-1)
    return GreedyScreen(rounded, block_max(residual), block_max(jnp.linalg.norm(rounded.astype(jnp.float32), axis=-1)))


def screened_greedy(hidden: jax.Array, weight: jax.Array, screen: GreedyScreen) -> jax.Array:
    """`greedy_ids(hidden @ weight.T)` for a float32 lm_head, reading it mostly in bfloat16.

    The argmax of the float32 logits is found without computing all of them: (1) approximate logits A from the
    bfloat16 screen (hidden rounded too, float32 accumulation); (2) the float32 logits of every id in the
    SCREEN_BLOCKS blocks of SCREEN_BLOCK ids with the largest A, and their maximum m; (3) a certificate: every other
    block b must satisfy max(A over b) + err_b < m, with err_b bounding |A - logits| over the block by
    Cauchy-Schwarz on the two rounding residuals, ||h|| * residual_norm[b] + ||h - bf16(h)|| * norm[b], plus the
    float32 accumulation error of both products (H * 2^-24 relative each), times 1.05. Rows without a certificate
    (near ties across blocks) take the float32 logits of the whole vocabulary (one `lax.cond` for the step). So the
    result is the float32 argmax, lowest id on ties: the tokens of the unscreened program. Steps with a logit bias
    or banned ids run the sample program (engine/runner/step_executor.py), so none reach this one.

    Why: greedy decode at a small batch reads the whole lm_head every step; on XLA:CPU (where the model
    computes in float32) that read is the largest cost of a decode step, and bfloat16 halves it.

    hidden: [B, H] float32; weight: [V, H] float32; screen: greedy_screen(weight). Returns [B] int32.
    """
    (b, h), v = hidden.shape, weight.shape[0]
    rows = jnp.arange(b)[:, None]
    rounded = hidden.astype(jnp.bfloat16)

    def approx_block_max(x: jax.Array) -> jax.Array:  # [n, H] bfloat16 -> [n, nb]: max of A per block
        n = x.shape[0]
        # One row pads to two: XLA:CPU's bfloat16 matrix-vector product is 13x slower than this.
        approx = jnp.einsum("nh,vh->nv", jnp.pad(x, ((0, 1), (0, 0))) if n == 1 else x, screen.weight,
                            preferred_element_type=jnp.float32)[:n]
        return jnp.max(vocab_blocks(approx, NEG_INF, SCREEN_BLOCK), axis=-1)

    # Rows per product
    # (2-core CPU): with glibc's defaults a [64, V] float32 result (64 MB, above its 32 MiB mmap
    # threshold) is page-faulted in on every call, 4.7x the time of 32 rows; with the host allocator's
    # settings the 128-row sampling program took 24.9 ms with one product, 27.4 ms with two of 64 (YNNPACK's
    # bfloat16 product runs at ~275 GFLOP/s at 64 rows, ~345 at 128).
    rows_per = SCREEN_ROWS_KEPT_MEMORY if host_memory_kept() else SCREEN_ROWS
    block_max = jnp.concatenate([approx_block_max(rounded[i : i + rows_per]) for i in range(0, b, rows_per)])
    k = min(SCREEN_BLOCKS, block_max.shape[1])
    chosen = jnp.sort(jax.lax.top_k(block_max, k)[1], axis=-1)  # [B, k] ascending: ties keep the lowest id
    ids = (chosen[:, :, None] * SCREEN_BLOCK + jnp.arange(SCREEN_BLOCK)).reshape(b, k * SCREEN_BLOCK)
    exact = jnp.einsum("nh,nch->nc", hidden, weight[jnp.minimum(ids, v - 1)],
                       preferred_element_type=jnp.float32)
    exact = jnp.where(ids < v, exact, NEG_INF)
    best, pos = jax.lax.top_k(exact, 1)
    winner = jnp.take_along_axis(ids, pos, axis=1)[:, 0].astype(jnp.int32)
    h_norm = jnp.linalg.norm(hidden, axis=-1, keepdims=True)
    h_residual = jnp.linalg.norm(hidden - rounded.astype(jnp.float32), axis=-1, keepdims=True)
    accumulation = 2 * h * 2.0**-24 * h_norm * (screen.norm + screen.residual_norm)
    err = 1.05 * (h_norm * screen.residual_norm + h_residual * screen.norm + accumulation)  # [B, nb]
    others = jnp.ones(block_max.shape, jnp.bool_).at[rows, chosen].set(False)
    bound = jnp.where(others, block_max + err, -jnp.inf)
    certified = jnp.all(bound < best, axis=-1) & (best[:, 0] > NEG_INF)

    def full() -> jax.Array:
        return greedy_ids(jnp.einsum("nh,vh->nv", hidden, weight, preferred_element_type=jnp.float32))

    return jax.lax.cond(~jnp.all(certified), full, lambda: winner)
