"""ImageInputs: a request's image references to ``ImageItem`` objects, every rule of the operator applied."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

from sglang_tpu_qwen.engine.io.multimodal import ImageItem
from sglang_tpu_qwen.multimodal.errors import ImageInputError
from sglang_tpu_qwen.multimodal.image_decode import decode_image
from sglang_tpu_qwen.multimodal.image_source import read_image_bytes
from sglang_tpu_qwen.multimodal.media_limits import MediaLimits
from sglang_tpu_qwen.multimodal.preprocess import ImagePreprocessor

NOT_ACCEPTED = "this model does not accept images"


class ImageInputs:
    """Loads, checks and preprocesses the images of one request at a time (thread-safe: no state per request).

    Args:
        limits: the operator's rules (media_limits.py).
        preprocessor: the checkpoint's image preprocessor; None for a checkpoint without a vision tower.
        engine_accepts: whether the engine serves images now (``Engine.accepts_images``).
    """

    def __init__(self, limits: MediaLimits, preprocessor: ImagePreprocessor | None,
                 engine_accepts: Callable[[], bool]) -> None:
        self.limits = limits
        self.preprocessor = preprocessor
        self._engine_accepts = engine_accepts

    @classmethod
    def for_engine(cls, engine: Any, limits: MediaLimits | None = None) -> ImageInputs:
        """The image inputs of an Engine: its checkpoint's preprocessor, bounded by the vision encoder's largest
        bucket (``engine.runner.vision_encoder.max_patches``, preprocess.py), and its server_args' limits (or
        ``limits``). Raises ValueError as ImagePreprocessor.from_checkpoint."""
        limits = limits if limits is not None else MediaLimits.from_server_args(engine.server_args)
        encoder = getattr(getattr(engine, "runner", None), "vision_encoder", None)
        max_patches = None if encoder is None else int(encoder.max_patches)
        return cls(limits, ImagePreprocessor.from_checkpoint(engine.model_path, max_patches),
                   lambda: bool(getattr(engine, "accepts_images", False)))

    @property
    def pad_id(self) -> int | None:
        """The image pad token id of the checkpoint; None without a vision tower."""
        return None if self.preprocessor is None else self.preprocessor.tokens.image_pad

    def accepted(self) -> bool:
        """Whether images can be served now: a vision checkpoint and an engine path for them."""
        return self.preprocessor is not None and self._engine_accepts()

    def check_count(self, count: int) -> None:
        """Raise ImageInputError when a request carries more images than the limit (checked before any load)."""
        if count > self.limits.max_images:
            raise ImageInputError(f"the request has {count} images, above the limit of {self.limits.max_images} "
                                  "per request (--limit-mm-data-per-request)")

    def load(self, refs: Sequence[Any]) -> list[ImageItem]:
        """Read, decode and preprocess every image of a request, in order.

        Every image is read and decoded first (so a bad one is named whatever the model), then a model that
        takes no images is refused; only then are the images preprocessed.

        Raises:
            ImageInputError: too many images; an image that cannot be read or decoded, or is beyond a limit
                (the message names the image's index); or the model does not accept images.
        """
        self.check_count(len(refs))
        accepted = self.accepted()
        items = []
        for k, ref in enumerate(refs):
            try:
                image = decode_image(read_image_bytes(ref, self.limits), self.limits)
                if accepted:
                    assert self.preprocessor is not None
                    items.append(self.preprocessor(image))
            except ImageInputError as e:
                raise ImageInputError(f"image {k}: {e}") from None
        if not accepted:
            why = "no vision tower in the checkpoint" if self.preprocessor is None else \
                "the engine has no image path yet"
            raise ImageInputError(f"{NOT_ACCEPTED} ({why})")
        return items

    async def aload(self, refs: Sequence[Any]) -> list[ImageItem]:
        """`load` on a worker thread, so decoding and preprocessing do not block the event loop."""
        self.check_count(len(refs))
        return await asyncio.to_thread(self.load, refs)
