"""`/generate`'s `image_data` (SGLang's field): the images of each prompt, loaded, and the prompts' pad tokens
expanded (sglang_tpu_qwen/multimodal)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sglang_tpu_qwen.engine.io.errors import InvalidRequestError
from sglang_tpu_qwen.multimodal.prompt_tokens import expand_image_pads

if TYPE_CHECKING:
    from sglang_tpu_qwen.engine.engine import Engine
    from sglang_tpu_qwen.multimodal.image_inputs import ImageInputs


def image_refs(image_data: Any, batch_size: int | None) -> list[list[str]]:
    """The image references of each prompt (one list for a single request).

    A single request takes a reference or a list of them; a batch takes one entry per prompt, each a reference,
    a list of them or null. Raises InvalidRequestError for another shape.
    """
    def one(entry: Any, where: str) -> list[str]:
        if entry is None:
            return []
        if isinstance(entry, str):
            return [entry]
        if isinstance(entry, list) and all(isinstance(r, str) for r in entry):
            return list(entry)
        raise InvalidRequestError(f"{where} must be an image reference (a string) or a list of them")

    if batch_size is None:
        return [one(image_data, "image_data")]
    if not isinstance(image_data, list) or len(image_data) != batch_size:
        raise InvalidRequestError(f"image_data of a batch must be a list with one entry per prompt ({batch_size})")
    return [one(entry, f"image_data[{i}]") for i, entry in enumerate(image_data)]


async def with_images(engine: Engine, images: ImageInputs, kwargs: dict[str, Any], image_data: Any,
                      batch_size: int | None) -> dict[str, Any]:
    """Engine keywords with the images of `image_data` loaded and each prompt as ids with its pad tokens
    expanded: `input_ids` and `images` replace `text` / `input_ids`.

    Raises:
        InvalidRequestError (ImageInputError): a bad shape, too many images (over the whole call), an image that
            cannot be loaded, a model that takes no images, or placeholders that do not match the images.
    """
    refs = image_refs(image_data, batch_size)
    total = sum(len(r) for r in refs)
    if total == 0:
        return kwargs
    images.check_count(total)
    items = [await images.aload(r) if r else [] for r in refs]
    pad = images.pad_id
    assert pad is not None  # aload refuses a model without a vision tower
    text, ids = kwargs.get("text"), kwargs.get("input_ids")
    if text is not None:
        prompts = [engine.tokenizer.encode(t) if isinstance(t, str) else t
                   for t in (text if batch_size is not None else [text])]
    else:
        prompts = list(ids) if batch_size is not None else [ids]
    expanded = []
    for i, (prompt, prompt_items) in enumerate(zip(prompts, items, strict=True)):
        if not isinstance(prompt, list):
            raise InvalidRequestError("text must be a string or a list of strings")
        try:
            expanded.append(expand_image_pads(prompt, prompt_items, pad) if prompt_items else prompt)
        except InvalidRequestError as e:
            raise type(e)(f"prompt {i}: {e}" if batch_size is not None else str(e)) from None
    out = {k: v for k, v in kwargs.items() if k not in ("text", "input_ids")}
    out["input_ids"] = expanded if batch_size is not None else expanded[0]
    out["images"] = items if batch_size is not None else items[0]
    return out
