"""RequestImages: what a request with images needs beyond its token ids (positions, cache keys, embeddings).

Built once when the request is made, kept for its whole life (a retracted request re-prefills with the same
positions and embeddings):

- the prompt's M-RoPE positions and rope delta (model/mrope.py, HF ``get_rope_index``);
- the prefix-cache key: the prompt ids with each image's pad tokens replaced by an id derived from the image's
  content hash (SGLang's ``pad_value``), above the vocabulary so no text token can match it: the same image at
  the same place hits, another image misses;
- each image's embeddings, encoded when a step first needs them (``encode``: the vision encoder's call), kept as
  host float32 rows until a step has fed the image's last token (a re-prefill after a retraction encodes again;
  the vision encoder's cache, keyed by content hash, makes that cheap).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from sglang_tpu_qwen.engine.io.multimodal import ImageItem
from sglang_tpu_qwen.model.mrope import mrope_positions

Encode = Callable[[list[ImageItem]], Sequence[Any]]  # images -> per image [num_tokens, hidden] arrays
KEY_SPACE = 1 << 62  # hash-derived pad ids lie in [vocab_size, vocab_size + KEY_SPACE)


class RequestImages:
    """The images of one request and what the scheduler derives from them.

    Attributes:
        images: the request's images in prompt order.
        positions: ``[L, 3]`` int32 M-RoPE positions of the L prompt tokens.
        rope_delta: decode and the text after the last image sit at ``index + rope_delta``.
        spans: ``(start, end)`` prompt indices of each image's pad tokens.
        key_ids: the prompt ids with image pad tokens replaced by hash-derived ids (the radix key).
    """

    def __init__(self, prompt_ids: list[int], images: list[ImageItem], image_token_id: int, vocab_size: int) -> None:
        """Raises ValueError when the prompt's image pad tokens do not match the images (one run of
        ``num_tokens`` pads per image, in order)."""
        self.images = images
        merge = images[0].merge_size if images else 1
        self.positions, self.rope_delta = mrope_positions(prompt_ids, [im.grid_thw for im in images], image_token_id,
                                                          merge)
        ids = np.asarray(prompt_ids, np.int64)
        self.spans: list[tuple[int, int]] = []
        key = list(prompt_ids)
        pos = 0
        for im in images:  # mrope_positions checked the runs (images may sit back to back)
            start = pos + int(np.argmax(ids[pos:] == image_token_id))
            self.spans.append((start, start + im.num_tokens))
            key[start : start + im.num_tokens] = [vocab_size + im.content_hash % KEY_SPACE] * im.num_tokens
            pos = start + im.num_tokens
        self.key_ids = key
        self._embeds: list[np.ndarray | None] = [None] * len(images)

    def has_image_tokens(self, start: int, end: int) -> bool:
        """Some token of ``[start, end)`` is an image pad token."""
        return any(s < end and start < e for s, e in self.spans)

    def text_delta(self, start: int) -> int:
        """Rotary offset of text tokens from index ``start`` up to the next image: position - index."""
        if start >= len(self.positions):
            return self.rope_delta
        return int(self.positions[start, 0]) - start

    def mrope(self, start: int, end: int) -> np.ndarray:
        """``[end - start, 3]`` int32 positions of tokens ``[start, end)`` (output tokens: ``index + delta``)."""
        n = len(self.positions)
        out = np.empty((end - start, 3), np.int32)
        inner = max(min(end, n) - start, 0)
        out[:inner] = self.positions[start : start + inner]
        out[inner:] = (np.arange(start + inner, end, dtype=np.int32) + self.rope_delta)[:, None]
        return out

    def embeds(self, start: int, end: int, hidden: int, encode: Encode) -> np.ndarray:
        """``[end - start, hidden]`` float32: the image embedding rows of tokens ``[start, end)`` (zeros for text).

        Encodes (one ``encode`` call) the images overlapping the range that were not encoded yet. Raises
        ValueError when the encoder returns an array of the wrong shape."""
        todo = [k for k, (s, e) in enumerate(self.spans) if s < end and start < e and self._embeds[k] is None]
        if todo:
            for k, arr in zip(todo, encode([self.images[k] for k in todo]), strict=True):
                rows = np.asarray(arr, np.float32)
                if rows.shape != (self.images[k].num_tokens, hidden):
                    raise ValueError(f"the encoder gave {rows.shape} for an image of {self.images[k].num_tokens} "
                                     f"tokens (hidden {hidden})")
                self._embeds[k] = rows
        out = np.zeros((end - start, hidden), np.float32)
        for k, (s, e) in enumerate(self.spans):
            lo, hi = max(s, start), min(e, end)
            if lo < hi:
                rows = self._embeds[k]
                assert rows is not None
                out[lo - start : hi - start] = rows[lo - s : hi - s]
                if hi == e:  # the image's last token is in this range: its rows are not needed again
                    self._embeds[k] = None
        return out
