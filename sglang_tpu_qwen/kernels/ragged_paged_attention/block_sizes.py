"""Block sizes of the ragged paged attention kernel, per TPU generation.

``decode_seqs``: rows (one query token each) walked per grid step at decode; within a grid step the next row's
first key block loads while this row's last one computes, so more rows per step means fewer pipeline bubbles.
Steps of up to ``short_q_rows`` query rows a row (T tokens x G heads: an MTP verify's 4 tokens are 32 rows at
G = 8) take the same path with ``decode_seqs / T`` rows per grid step.
``prefill_q``: query tokens per grid step for prefill chunks; the score tile is ``[prefill_q * G, block_keys]``
float32 per KV head. ``block_keys``: keys per inner step (``block_keys / page_size`` pages, one DMA each per
pool, double-buffered).

Measured on one TPU v5e chip (2026-12-05, Qwen3.5 attention: 16 query / 2 KV heads of 256, bf16, the dev sweep
of this kernel in docs/performance.md): decode streamed 408-628 GB/s at pages of 64 with blocks of 512 to 2048
keys alike (the block size moves it by under 2%), so ``block_keys`` is 1024; prefill 8 x 4096 ran at 78 TFLOP/s
with 128 query tokens per step and 1024 keys. A prefill step holds at most ``prefill_rows`` = 1024 query rows
(128 tokens x G = 8; 64 tokens of the 397B's G = 16): 1024 x 1024 float32 scores per head and their exponentials
(8 MiB for two heads), the float32 accumulator and its max / sum rows (3 MiB) and the double-buffered K and V
blocks (4 MiB); 2048 rows did not fit Ironwood's 48 MiB scoped limit (the deviceless compile). Ironwood (64 MiB of VMEM
per TensorCore) is checked by the deviceless compile (tests/test_kernels_aot_ironwood.py), not tuned on it.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax


@dataclass(frozen=True)
class BlockSizes:
    """Tiling of one kernel call (see module docstring).

    Attributes:
        decode_seqs: rows per grid step when every row has one query token (T == 1); ``decode_seqs / T`` for
            short steps (``T x G <= short_q_rows``).
        short_q_rows: largest ``T x G`` (query rows of one KV head in a row) run as a short step, every token of a
            row in one query block.
        prefill_q: query tokens per grid step of longer steps (``T x G > short_q_rows``; clipped to T and to
            ``prefill_rows / G``).
        prefill_rows: query rows (tokens x the G query heads of a KV head) per grid step at most; bounds the
            float32 score tile (the 397B's G = 16 halves ``prefill_q`` against the 35B's G = 8).
        block_keys: keys per inner step (rounded down to whole pages, at least one page).
        vmem_limit_bytes: scoped VMEM limit handed to Mosaic.
    """

    decode_seqs: int = 128
    short_q_rows: int = 128
    prefill_q: int = 128
    prefill_rows: int = 1024
    block_keys: int = 1024
    vmem_limit_bytes: int = 48 * 1024 * 1024


# Per generation (``device_kind``: "TPU7x", "TPU v6 lite", "TPU v5 lite"); any other device (interpret mode on a
# CPU) takes the BlockSizes defaults.
GENERATION: dict[str, BlockSizes] = {
    "TPU7x": BlockSizes(vmem_limit_bytes=48 << 20),
    "TPU v6 lite": BlockSizes(vmem_limit_bytes=64 << 20),
    "TPU v5 lite": BlockSizes(vmem_limit_bytes=64 << 20),
}


# Interpret mode (CPU tests): every page of a key block costs an op for its fetch condition whether the row
# reaches it or not, so short blocks are cheaper there (an engine test on the CPU: 153 -> 80 s at 128 keys).
INTERPRET = BlockSizes(block_keys=128)


def block_sizes_for(generation: str | None = None) -> BlockSizes:
    """Block sizes on a TPU generation (one entry per generation: the measured sizes did not depend on the head
    dim or the page size, module docstring).

    Args:
        generation: ``device_kind`` of the target chip; ``None`` reads it from ``jax.devices()[0]``.

    Returns:
        The generation's entry, else ``BlockSizes()``.
    """
    if generation is None:
        generation = jax.devices()[0].device_kind
    return GENERATION.get(generation, BlockSizes())
