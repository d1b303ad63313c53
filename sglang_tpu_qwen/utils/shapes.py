"""Small helpers every layer of the package may use (nothing here imports the package)."""

from __future__ import annotations

import math


def next_pow2(n: int, minimum: int = 1) -> int:
    """Smallest power of two >= max(n, minimum); the bucket rule for padded shapes."""
    return max(minimum, 1 << max(0, math.ceil(math.log2(max(n, 1)))))
