"""A decoded image to an ``ImageItem``, as Qwen3.5's processor does it: transformers' image processor of the
checkpoint (``preprocessor_config.json``: patch, merge and temporal patch sizes, min / max pixels, mean / std)."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from sglang_tpu_qwen.engine.io.multimodal import ImageItem, content_hash
from sglang_tpu_qwen.multimodal.errors import ImageInputError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class VisionTokens:
    """The special token ids of images in the prompt (a VL checkpoint's config.json)."""

    image_pad: int  # ``image_token_id``: one per image in the rendered prompt, num_tokens once expanded
    vision_start: int
    vision_end: int


class ImagePreprocessor:
    """transformers' image processor of one checkpoint, and the token ids its images use.

    Args:
        processor: a transformers image processor (``AutoImageProcessor.from_pretrained``, the Qwen2-VL one for
            Qwen3.5), called with ``images=[PIL image], return_tensors="np"``.
        merge_size: the vision config's ``spatial_merge_size`` (tokens per image = patches / merge_size**2).
        tokens: the prompt's image token ids.
        max_patches: the most patches an image may have after preprocessing (the vision encoder's largest
            bucket); None: no bound.
    """

    def __init__(self, processor: Any, merge_size: int, tokens: VisionTokens, max_patches: int | None = None) -> None:
        self.processor = processor
        self.merge_size = merge_size
        self.tokens = tokens
        self.max_patches = max_patches

    @classmethod
    def from_checkpoint(cls, path: str | Path, max_patches: int | None = None) -> ImagePreprocessor | None:
        """The preprocessor of a checkpoint directory; None when the checkpoint takes no images (its config.json
        has no ``vision_config`` or ``image_token_id``, or there is no ``preprocessor_config.json``).

        ``max_patches``: the vision encoder's largest bucket. Where the processor would resize an image to more
        pixels than that holds (``size.longest_edge``, Qwen's max_pixels), its bound is lowered to
        ``max_patches * patch_size**2`` (logged): larger images are resized smaller rather than refused.

        Raises:
            ValueError: the processor's merge size differs from the vision config's (a broken checkpoint), or
                its smallest image (``size.shortest_edge``, min_pixels) is larger than ``max_patches`` holds.
        """
        path = Path(path)
        config_file, proc_file = path / "config.json", path / "preprocessor_config.json"
        if not config_file.is_file() or not proc_file.is_file():
            return None
        config = json.loads(config_file.read_text(encoding="utf-8"))
        vision = config.get("vision_config")
        if not isinstance(vision, dict) or "image_token_id" not in config:
            return None
        from transformers import AutoImageProcessor  # imported only for a checkpoint that takes images

        processor = AutoImageProcessor.from_pretrained(str(path))
        merge = int(vision.get("spatial_merge_size", 2))
        if int(getattr(processor, "merge_size", merge)) != merge:
            raise ValueError(f"{proc_file}: merge_size {processor.merge_size} differs from the vision config's "
                             f"spatial_merge_size {merge}")
        tokens = VisionTokens(image_pad=int(config["image_token_id"]),
                              vision_start=int(config["vision_start_token_id"]),
                              vision_end=int(config["vision_end_token_id"]))
        if max_patches is not None:
            processor = _bounded(processor, str(path), max_patches)
        return cls(processor, merge, tokens, max_patches)

    def __call__(self, image: Any) -> ImageItem:
        """One image (a loaded PIL image in any mode) as an ``ImageItem``.

        The image is converted to RGB as the processor's ``do_convert_rgb`` does (transparency over white), and
        ``content_hash`` is taken of those RGB pixels: equal pixels give equal processor output, so the hash
        identifies what the vision tower sees.

        Raises:
            ImageInputError: a shape the processor cannot resize (``check_shape``), or more patches than
                ``max_patches`` after preprocessing.
        """
        from PIL import Image
        from transformers.image_transforms import convert_to_rgb

        self.check_shape(*image.size)
        rgb = convert_to_rgb(image, return_numpy=True)  # uint8 [H, W, 3]
        out = self.processor(images=[Image.fromarray(rgb)], return_tensors="np")
        grid = tuple(int(v) for v in np.asarray(out["image_grid_thw"])[0])
        pixels = np.ascontiguousarray(np.asarray(out["pixel_values"], dtype=np.float32))
        assert len(grid) == 3 and pixels.shape[0] == grid[0] * grid[1] * grid[2], (grid, pixels.shape)
        if self.max_patches is not None and pixels.shape[0] > self.max_patches:  # a processor that does not resize
            raise ImageInputError(f"the image is {pixels.shape[0]} patches after preprocessing, above the vision "
                                  f"encoder's largest bucket of {self.max_patches} (--mm-max-patches)")
        return ImageItem(grid_thw=(grid[0], grid[1], grid[2]), content_hash=content_hash(rgb),
                         pixel_values=pixels, merge_size=self.merge_size)

    def check_shape(self, width: int, height: int) -> None:
        """Refuse an image of ``width`` x ``height`` pixels that the processor's resize would refuse.

        The processor's own rule decides, so its limits are not copied here: ``get_number_of_image_patches``
        runs the same ``smart_resize`` with the same factor and min / max pixels as the resize, and raises the
        same ValueError, which names the limit (transformers 5.24: "absolute aspect ratio must be smaller than
        200, got 300.0"). Left to the resize, that ValueError escaped the HTTP layer as a 500. A processor
        without the method is called as is.

        Raises:
            ImageInputError: no pixels, or a shape the processor refuses (its message quoted).
        """
        if width <= 0 or height <= 0:
            raise ImageInputError(f"the image is {width} x {height} pixels: an image needs at least 1 x 1")
        count = getattr(self.processor, "get_number_of_image_patches", None)
        if count is None:
            return
        try:
            count(height, width)
        except ValueError as e:
            raise ImageInputError(f"the image is {width} x {height} pixels, a shape the checkpoint's image "
                                  f"processor cannot resize: {e}") from None


def _size(processor: Any, key: str) -> int | None:
    """``processor.size[key]`` (a dict, or transformers' SizeDict), or None."""
    size = getattr(processor, "size", None) or {}
    value = size.get(key) if isinstance(size, dict) else getattr(size, key, None)
    return int(value) if value else None


def _bounded(processor: Any, path: str, max_patches: int) -> Any:
    """``processor``, or one re-read from ``path`` whose ``size.longest_edge`` (max pixels) fits ``max_patches``
    patches. Raises ValueError when its ``size.shortest_edge`` (min pixels) does not fit."""
    patch = int(getattr(processor, "patch_size", 14))
    cap = max_patches * patch * patch
    low, high = _size(processor, "shortest_edge"), _size(processor, "longest_edge")
    if low is not None and low > cap:
        raise ValueError(f"{path}/preprocessor_config.json resizes every image to at least {low} pixels, above the "
                         f"vision encoder's largest bucket ({max_patches} patches of {patch}x{patch} = {cap} "
                         "pixels); raise --mm-max-patches")
    if not getattr(processor, "do_resize", True) or (high is not None and high <= cap):
        return processor
    from transformers import AutoImageProcessor

    logger.warning("images are resized to at most %d pixels (%d patches: the vision encoder's largest bucket, "
                   "--mm-max-patches), below the %s pixels the checkpoint's preprocessor allows", cap, max_patches,
                   high if high is not None else "unbounded")
    return AutoImageProcessor.from_pretrained(path, size={"shortest_edge": low or patch * patch, "longest_edge": cap})
