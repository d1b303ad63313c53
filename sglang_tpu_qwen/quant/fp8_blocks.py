"""Block-FP8 on the host (numpy), for the loader: dequantise a checkpoint tensor, or quantise a dense one.

Format of the Qwen3 / DeepSeek-V3 FP8 releases: ``w = q * scale`` per ``block`` tile, ``q`` float8_e4m3fn,
``scale`` float32 (``weight_scale_inv`` in the checkpoint: it multiplies, despite its name); tiles tile
the last two dims and the last tile of a row or column may be partial (``scale`` has
``ceil(R / block[0]) x ceil(C / block[1])`` entries). The device-side twin is ``quant/fp8.py``.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

E4M3_MAX = 448.0  # largest finite float8_e4m3fn


def scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    """Scale grid of a ``[..., R, C]`` weight: ``[..., ceil(R / block[0]), ceil(C / block[1])]``."""
    *lead, r, c = shape
    return (*lead, -(-r // block[0]), -(-c // block[1]))


def dequantize(q: np.ndarray, scale: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """``[..., R, C]`` float32: each tile of ``q`` (any float8) times its entry of ``scale``."""
    r, c = q.shape[-2:]
    s = np.repeat(np.repeat(scale.astype(np.float32), block[0], axis=-2), block[1], axis=-1)
    return q.astype(np.float32) * s[..., :r, :c]


def quantize(w: np.ndarray, block: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """Blockwise absmax quantisation of ``w [..., R, C]`` (any float dtype) to float8_e4m3fn.

    Returns ``(q [..., R, C] float8_e4m3fn, scale scale_shape(...) float32)`` with
    ``scale = max|tile| / 448`` (1 for an all-zero tile), so every tile uses the full e4m3 range.
    """
    *lead, r, c = w.shape
    gr, gc = scale_shape(w.shape, block)[-2:]
    padded = np.zeros((*lead, gr * block[0], gc * block[1]), np.float32)
    padded[..., :r, :c] = w
    tiles = padded.reshape(*lead, gr, block[0], gc, block[1])
    amax = np.abs(tiles).max(axis=(-3, -1))
    scale = np.where(amax > 0, amax / E4M3_MAX, 1.0).astype(np.float32)
    q = np.clip(tiles / scale[..., :, None, :, None], -E4M3_MAX, E4M3_MAX)
    q = q.reshape(padded.shape)[..., :r, :c].astype(ml_dtypes.float8_e4m3fn)
    return q, scale
