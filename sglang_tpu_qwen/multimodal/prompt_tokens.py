"""The prompt side of images: each image's pad token expanded to the image's ``num_tokens`` copies."""

from __future__ import annotations

from collections.abc import Sequence

from sglang_tpu_qwen.engine.io.multimodal import ImageItem
from sglang_tpu_qwen.multimodal.errors import ImageInputError


def pad_runs(ids: Sequence[int], pad_id: int) -> list[tuple[int, int]]:
    """(start, length) of each maximal run of ``pad_id`` in ``ids``, in order."""
    runs: list[tuple[int, int]] = []
    i, n = 0, len(ids)
    while i < n:
        if ids[i] == pad_id:
            j = i
            while j < n and ids[j] == pad_id:
                j += 1
            runs.append((i, j - i))
            i = j
        else:
            i += 1
    return runs


def expand_image_pads(ids: Sequence[int], images: Sequence[ImageItem], pad_id: int) -> list[int]:
    """The prompt with image ``k``'s pad run holding ``images[k].num_tokens`` pad tokens.

    Each image is one run of consecutive pad tokens, in the order of ``images`` (the chat template puts one pad
    between ``<|vision_start|>`` and ``<|vision_end|>``). A run of one pad is expanded; a run already
    ``num_tokens`` long (a prompt expanded before, e.g. ids read back from a reply) is kept.

    Raises:
        ImageInputError: the number of pad runs differs from the number of images, or a run is neither 1 nor
            that image's ``num_tokens`` long.
    """
    runs = pad_runs(ids, pad_id)
    if len(runs) != len(images):
        raise ImageInputError(f"the prompt has {len(runs)} image placeholder(s) (<|image_pad|> runs) for "
                              f"{len(images)} image(s): each image needs one, in order")
    out: list[int] = []
    prev = 0
    for k, ((start, length), image) in enumerate(zip(runs, images, strict=True)):
        if length not in (1, image.num_tokens):
            raise ImageInputError(f"image {k}: its placeholder is {length} <|image_pad|> tokens; it must be 1 "
                                  f"(expanded here) or the image's {image.num_tokens} tokens")
        out.extend(ids[prev:start])
        out.extend([pad_id] * image.num_tokens)
        prev = start + length
    out.extend(ids[prev:])
    return out
