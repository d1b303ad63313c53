"""Host-side per-call arrays of the vision tower: everything that depends on the images' grids, not on pixels.

The tower's program then depends only on its patch-count bucket (engine/runner/vision_encoder.py): the
bilinear taps into the learned position table, the 2-D rotary positions and the attention segment of every
patch row are computed here in numpy and passed in as arrays. The math is HF's ``transformers.vision_utils``
(``get_vision_interpolation_indices_and_weights`` with bilinear, ``align_corners=True``, spatial-merge-block
order; ``get_vision_position_ids``; ``get_vision_cu_seqlens``: one attention segment per frame), as
``Qwen3_5VisionModel.forward`` calls it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import numpy as np

from sglang_tpu_qwen.model.vision.config import VisionConfig

Grid = tuple[int, int, int]  # (t, h, w) patches of one image, before the spatial merge


@dataclasses.dataclass(frozen=True)
class TowerInputs:
    """The grid-derived arrays of one tower call over ``N`` patch rows (real rows first, then padding).

    Attributes:
        pos_index: ``[N, 4]`` int32 rows of the learned position table each patch interpolates (2 x 2 taps).
        pos_weight: ``[N, 4]`` float32 bilinear weights of those rows (0 on padding rows).
        rope_hw: ``[N, 2]`` int32 (row, column) of the patch in its image, the 2-D rotary positions.
        segment: ``[N]`` int32 attention segment (one per frame of each image; padding rows share one
            segment of their own, so every row attends to something and real rows never see padding).
    """

    pos_index: np.ndarray
    pos_weight: np.ndarray
    rope_hw: np.ndarray
    segment: np.ndarray

    @property
    def num_rows(self) -> int:
        return int(self.segment.shape[0])


jax.tree_util.register_dataclass(TowerInputs, data_fields=["pos_index", "pos_weight", "rope_hw", "segment"],
                                 meta_fields=[])


def num_patches(grid: Grid) -> int:
    """Patch rows of one image: ``t * h * w``."""
    t, h, w = grid
    return t * h * w


def _block_order(h: int, w: int, merge: int) -> tuple[np.ndarray, np.ndarray]:
    """(row, column) of each patch of an ``h x w`` frame in spatial-merge-block order (the processor's and
    HF's row order: blocks of ``merge x merge`` patches, raster over blocks, raster inside a block)."""
    rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
    shape = (h // merge, merge, w // merge, merge)
    return rows.reshape(shape).transpose(0, 2, 1, 3).ravel(), cols.reshape(shape).transpose(0, 2, 1, 3).ravel()


def _axis_taps(index: np.ndarray, size: int, side: int) -> tuple[np.ndarray, np.ndarray]:
    """Bilinear taps (floor, floor + 1, clamped to the table) and weights along one axis, ``align_corners``:
    target position ``i`` of ``size`` maps to ``i * (side - 1) / (size - 1)`` in the table (float32, as HF)."""
    src = index.astype(np.float32) * np.float32(side - 1) / np.float32(max(size - 1, 1))
    floor = np.floor(src)
    offsets = np.arange(2)
    taps = np.clip(floor.astype(np.int64)[:, None] + offsets, 0, side - 1)
    weights = np.clip(1 - np.abs(src[:, None] - floor[:, None] - offsets.astype(np.float32)), 0, None)
    return taps, weights.astype(np.float32)


def tower_inputs(grids: Sequence[Grid], config: VisionConfig, num_rows: int | None = None) -> TowerInputs:
    """Arrays for one call over the images ``grids`` (their patch rows concatenated in order), padded to
    ``num_rows`` (default: no padding).

    Raises:
        ValueError: a grid whose h or w is not a multiple of ``spatial_merge_size``, or more patches than
            ``num_rows``.
    """
    m, side = config.spatial_merge_size, config.grid_side
    index, weight, hw, segment = [], [], [], []
    seg = 0
    for t, h, w in grids:
        if h % m or w % m or min(t, h, w) < 1:
            raise ValueError(f"image grid {(t, h, w)}: h and w must be positive multiples of the merge size {m}")
        rows, cols = _block_order(h, w, m)
        h_taps, h_w = _axis_taps(rows, h, side)
        w_taps, w_w = _axis_taps(cols, w, side)
        idx = (h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(-1, 4)
        wt = (h_w[:, :, None] * w_w[:, None, :]).reshape(-1, 4)
        for _ in range(t):  # every frame of a clip: the same positions, its own attention segment
            index.append(idx)
            weight.append(wt)
            hw.append(np.stack([rows, cols], axis=-1))
            segment.append(np.full(h * w, seg))
            seg += 1
    total = sum(num_patches(g) for g in grids)
    rows_out = total if num_rows is None else num_rows
    if total > rows_out:
        raise ValueError(f"{total} patches do not fit a call of {rows_out} rows")
    pad = rows_out - total
    index.append(np.zeros((pad, 4), np.int64))
    weight.append(np.zeros((pad, 4), np.float32))
    hw.append(np.zeros((pad, 2), np.int64))
    segment.append(np.full(pad, seg))
    return TowerInputs(
        pos_index=np.concatenate(index).astype(np.int32), pos_weight=np.concatenate(weight).astype(np.float32),
        rope_hw=np.concatenate(hw).astype(np.int32), segment=np.concatenate(segment).astype(np.int32),
    )
