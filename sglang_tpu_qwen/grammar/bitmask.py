"""Host token bitmasks: one int32 row of ceil(V / 32) words per batch row, bit t % 32 of word t // 32 = token t.

The scheduler builds one per sampling step (`token_bitmask`) and the jitted sampling step unpacks it
(`engine.sampler.apply_token_bitmask`). Unconstrained rows and padding rows are all ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np


class RowFiller(Protocol):
    def fill(self, bitmask: np.ndarray, row: int) -> None: ...


class MaskRow:
    """A RowFiller that writes a row filled ahead (a speculative verify position's grammar mask)."""

    def __init__(self, row: np.ndarray) -> None:
        self.row = row  # [ceil(V / 32)] int32

    def fill(self, bitmask: np.ndarray, row: int) -> None:
        bitmask[row] = self.row


def bitmask_width(vocab_size: int) -> int:
    """int32 words per row for vocab_size tokens."""
    return (vocab_size + 31) // 32


def token_bitmask(grammars: Sequence[RowFiller | None], rows: int, vocab_size: int) -> np.ndarray | None:
    """The [rows, ceil(vocab_size / 32)] int32 bitmask of one step, or None when no row is constrained.

    grammars[i] fills row i (None: unconstrained, all ones); rows >= len(grammars) are padding (all ones).
    """
    if all(g is None for g in grammars):
        return None
    mask = np.full((rows, bitmask_width(vocab_size)), -1, np.int32)
    for i, g in enumerate(grammars):
        if g is not None:
            g.fill(mask, i)
    return mask


def clear_from(bitmask: np.ndarray, row: int, limit: int) -> None:
    """Disallow tokens >= limit in bitmask[row] (the model's padded vocabulary rows)."""
    words = bitmask.view(np.uint32)
    first, bit = divmod(limit, 32)
    if first < words.shape[1]:
        words[row, first] &= np.uint32((1 << bit) - 1)
        words[row, first + 1 :] = 0


def allows(bitmask: np.ndarray, row: int, token: int) -> bool:
    """Whether bitmask[row] allows `token` (an id < 32 * width)."""
    return bool((bitmask[row, token // 32].view(np.uint32) >> np.uint32(token % 32)) & 1)


def allows_other_than(bitmask: np.ndarray, row: int, ids: Sequence[int]) -> bool:
    """Whether bitmask[row] allows some token outside `ids` (token ids < 32 * width)."""
    words = bitmask[row].view(np.uint32).copy()
    for t in ids:
        words[t // 32] &= np.uint32(~(1 << (t % 32)) & 0xFFFFFFFF)
    return bool(words.any())


def unpack(bitmask: np.ndarray, vocab_size: int) -> np.ndarray:
    """[B, vocab_size] bool: which tokens each row allows (host-side twin of the device unpacking)."""
    bits = np.unpackbits(np.ascontiguousarray(bitmask).view(np.uint8), axis=-1, bitorder="little")
    return bits[:, :vocab_size].astype(bool)
