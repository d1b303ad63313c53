"""The image side of a step's model inputs (vision-language models): rope deltas, M-RoPE positions, embeddings.

A vision model's every step carries a rope delta per row (0 for a text request; model/mrope.py). A step in
which some row's chunk holds image pad tokens also carries explicit ``[B, T, 3]`` positions and the ``[B, T, H]``
image embeddings of its tokens, and runs the bucket's ``forward_mm`` program (engine/runner/programs.py). A chunk
may start or end inside an image: positions and embedding rows are per token.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from sglang_tpu_qwen.engine.io.request import Request
from sglang_tpu_qwen.engine.io.request_images import Encode
from sglang_tpu_qwen.model.forward_batch import ForwardBatch


def add_image_inputs(forward: ForwardBatch, reqs: list[Request], lens: list[int], rows: list[int], hidden: int,
                     encode: Encode | None) -> ForwardBatch:
    """`forward` (host arrays of a vision model's step) with rope_deltas, and with mrope_positions [B, T, 3] and
    image_embeds [B, T, H] float32 when a row's chunk holds image tokens. Image embeddings are encoded (by
    `encode`, once per image per request) when a chunk first needs them; RuntimeError when that is needed and
    there is no encoder (the engine refuses images without one)."""
    b, t = forward.input_ids.shape
    deltas = np.zeros(b, np.int32)
    mm_rows = []
    for r, n, i in zip(reqs, lens, rows, strict=True):
        if r.images is None:
            continue
        if r.images.has_image_tokens(r.cached_len, r.cached_len + n):
            mm_rows.append((r, n, i))
        else:
            deltas[i] = r.images.text_delta(r.cached_len)
    forward = dataclasses.replace(forward, rope_deltas=deltas)
    if not mm_rows:
        return forward
    if encode is None:
        raise RuntimeError("a step with image tokens and no vision encoder")
    positions = np.repeat((forward.prefix_lens[:, None] + np.arange(t, dtype=np.int32))[:, :, None], 3, axis=2)
    positions += deltas[:, None, None]
    embeds = np.zeros((b, t, hidden), np.float32)
    for r, n, i in mm_rows:
        assert r.images is not None
        start = r.cached_len
        positions[i, :n] = r.images.mrope(start, start + n)
        embeds[i, :n] = r.images.embeds(start, start + n, hidden, encode)
    return dataclasses.replace(forward, mrope_positions=positions.astype(np.int32), image_embeds=embeds)
