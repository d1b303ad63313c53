"""M-RoPE positions of a prompt with images, on the host (HF ``Qwen3_5Model.get_rope_index``, images only).

Qwen3.5 rotates each query / key with three position streams (time, height, width). A text token has the same
position in all three; an image's ``t x (h/m) x (w/m)`` tokens (``m`` the vision tower's spatial merge) take
``start + (t', h', w')`` from their place in the merged grid, where ``start`` is the position the image's first
token would have had as text; the text after the image continues from ``start + max(h, w) / m``. So after the
last image every token's position is ``index + rope_delta`` with the same delta in all streams, which is how
decode continues (HF keeps ``rope_deltas`` the same way).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def mrope_positions(input_ids: Sequence[int], grids: Sequence[tuple[int, int, int]], image_token_id: int,
                    merge_size: int) -> tuple[np.ndarray, int]:
    """The 3-D positions of a prompt and its rope delta.

    Args:
        input_ids: the prompt's L token ids; image ``i`` is the ``i``-th run of ``t*h*w / merge_size**2``
            consecutive ``image_token_id`` tokens.
        grids: ``(t, h, w)`` patch grid per image (HF ``image_grid_thw`` rows), in prompt order.
        image_token_id: the image pad token.
        merge_size: the vision config's ``spatial_merge_size``.

    Returns:
        ``(positions [L, 3] int32 (time, height, width), delta)``: token ``i`` at or after the last image token
        sits at ``i + delta`` in every stream (HF ``mrope_position_deltas``: max position + 1 - L).

    Raises:
        ValueError: the image tokens do not make exactly one run of the right length per grid.
    """
    ids = np.asarray(input_ids, np.int64)
    n = len(ids)
    out = np.empty((n, 3), np.int64)
    is_image = ids == image_token_id
    pos, i, k = 0, 0, 0  # next text position, next token, next image
    while i < n:
        if not is_image[i]:
            j = i + int(np.argmax(is_image[i:])) if is_image[i:].any() else n
            out[i:j] = (pos + np.arange(j - i))[:, None]
            pos += j - i
            i = j
            continue
        if k >= len(grids):
            raise ValueError(f"the prompt has more image token runs than the {len(grids)} images given")
        t, h, w = (int(x) for x in grids[k])
        gh, gw = h // merge_size, w // merge_size
        count = t * gh * gw
        if i + count > n or not is_image[i : i + count].all():
            raise ValueError(f"image {k} needs {count} consecutive image tokens at position {i}")
        tt, hh, ww = np.meshgrid(np.arange(t), np.arange(gh), np.arange(gw), indexing="ij")
        out[i : i + count] = pos + np.stack([tt.ravel(), hh.ravel(), ww.ravel()], axis=1)
        pos += max(gh, gw)
        i += count
        k += 1
    if k != len(grids):
        raise ValueError(f"{len(grids)} images given but the prompt has image tokens for {k}")
    delta = int(out.max()) + 1 - n if n else 0
    return out.astype(np.int32), delta
