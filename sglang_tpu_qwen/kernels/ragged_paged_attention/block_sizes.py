"""Block sizes of the ragged paged attention kernel, per TPU generation.

``decode_seqs``: decode sequences (one query token each) handled per grid step; a decode step of one sequence
is a ``[G, hd] x [hd, page]`` matmul, far too small to amortise the ~0.35 us per-step overhead, so several
share a step. ``prefill_q``: query tokens per grid step for prefill chunks; the score tile is
``[prefill_q * G, kv_pages * page_size]`` float32 per KV head, sized so scores, the accumulators and the K/V
page buffers fit the scoped VMEM limit with room for Mosaic's temporaries. ``kv_pages``: pages fetched per
inner step (``kv_pages * page_size`` keys).

Ironwood (TPU7x) has 64 MiB of VMEM per TensorCore. With Qwen3.5-397B's attention (G = 16 query heads per KV
head, head_dim 256, page 256, bf16 cache) one prefill step with ``prefill_q = 64`` holds a 1024-row query
tile, two 1024 x 256 fp32 accumulators (2 MiB) plus their max/sum rows (2 MiB), 1024 x 256 fp32 scores per
head (1 MiB) and the double-buffered K and V page buffers, which Mosaic pads from 2 to 16 sublanes
(``[page, nkv, hd]`` tiles: 2 MiB per page, 8 MiB in all); about 18 MiB, well under the 48 MiB limit asked
for. The table was checked by the deviceless Ironwood AOT compile (tests/test_kernels_aot_ironwood.py), not
tuned on hardware.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax


@dataclass(frozen=True)
class BlockSizes:
    """Tiling of one kernel call (see module docstring).

    Attributes:
        decode_seqs: sequences per grid step when every sequence has one query token (T == 1).
        prefill_q: query tokens per grid step when T > 1 (clipped to T).
        kv_pages: KV pages per inner step.
        vmem_limit_bytes: scoped VMEM limit handed to Mosaic.
    """

    decode_seqs: int = 8
    prefill_q: int = 32
    kv_pages: int = 1
    vmem_limit_bytes: int = 32 * 1024 * 1024


# (generation, head_dim, page_size) -> block sizes; generation as in ``device_kind`` ("TPU7x", "TPU v6 lite").
TABLE: dict[tuple[str, int, int], BlockSizes] = {
    ("TPU7x", 256, 256): BlockSizes(decode_seqs=8, prefill_q=64, kv_pages=1, vmem_limit_bytes=48 << 20),
    ("TPU7x", 128, 256): BlockSizes(decode_seqs=16, prefill_q=64, kv_pages=2, vmem_limit_bytes=48 << 20),
    ("TPU7x", 256, 128): BlockSizes(decode_seqs=8, prefill_q=64, kv_pages=2, vmem_limit_bytes=48 << 20),
    ("TPU7x", 128, 128): BlockSizes(decode_seqs=16, prefill_q=64, kv_pages=4, vmem_limit_bytes=48 << 20),
}

# Default per generation when the (head_dim, page_size) pair is not in TABLE; older chips have less VMEM.
GENERATION_DEFAULT: dict[str, BlockSizes] = {
    "TPU7x": BlockSizes(decode_seqs=8, prefill_q=64, kv_pages=1, vmem_limit_bytes=48 << 20),
    "TPU v6 lite": BlockSizes(decode_seqs=8, prefill_q=32, kv_pages=1, vmem_limit_bytes=32 << 20),
    "TPU v5": BlockSizes(decode_seqs=8, prefill_q=32, kv_pages=1, vmem_limit_bytes=32 << 20),
}


def block_sizes_for(head_dim: int, page_size: int, generation: str | None = None) -> BlockSizes:
    """Block sizes for a head_dim / page_size on a TPU generation.

    Args:
        head_dim: attention head dimension.
        page_size: tokens per KV page.
        generation: ``device_kind`` of the target chip; ``None`` reads it from ``jax.devices()[0]`` (any
            non-TPU device gets :class:`BlockSizes` defaults, which suit interpret mode).

    Returns:
        The table entry, else the generation default, else ``BlockSizes()``.
    """
    if generation is None:
        generation = jax.devices()[0].device_kind
    hit = TABLE.get((generation, head_dim, page_size))
    if hit is not None:
        return hit
    return GENERATION_DEFAULT.get(generation, BlockSizes())
