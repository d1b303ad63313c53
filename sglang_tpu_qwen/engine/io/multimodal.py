"""ImageItem: one image of a request, as the engine receives it (the contract between the HTTP layer, the vision
encoder and the scheduler).

The HTTP layer decodes and preprocesses an image (the checkpoint's ``preprocessor_config.json``, transformers'
Qwen2-VL image processor) and puts ``num_tokens`` copies of the config's ``image_token_id`` in the prompt, between
``<|vision_start|>`` and ``<|vision_end|>``, in the order of ``Request.images``. The vision encoder turns
``pixel_values`` into ``num_tokens`` rows of the text model's hidden size; the scheduler keys the image's tokens in
the prefix cache by ``content_hash`` (SGLang pads image tokens with hash-derived ids the same way), so the same
image at the same place hits and another image misses.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, eq=False)
class ImageItem:
    """One preprocessed image.

    Attributes:
        grid_thw: ``(t, h, w)`` patches before the spatial merge (HF ``image_grid_thw`` row); t = 1 for an image.
        content_hash: 63-bit hash of the decoded pixels (:func:`content_hash`); equal images, equal hash.
        pixel_values: ``[t*h*w, C*temporal_patch*patch*patch]`` float32, the processor's rows for this image.
        merge_size: the vision config's ``spatial_merge_size``.
    """

    grid_thw: tuple[int, int, int]
    content_hash: int
    pixel_values: np.ndarray
    merge_size: int

    @property
    def num_tokens(self) -> int:
        """Text-model tokens of this image: ``t * h * w / merge_size**2``."""
        t, h, w = self.grid_thw
        return t * h * w // (self.merge_size * self.merge_size)


def content_hash(pixels: np.ndarray) -> int:
    """63-bit hash of an array's shape and bytes (blake2b): the image's identity in the caches."""
    digest = hashlib.blake2b(np.ascontiguousarray(pixels).tobytes(), digest_size=8,
                             person=repr(pixels.shape).encode()[:16]).digest()
    return int.from_bytes(digest, "little") >> 1
