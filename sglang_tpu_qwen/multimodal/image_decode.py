"""Encoded bytes to a Pillow image: PNG, JPEG or WebP, the pixel limit checked from the header first."""

from __future__ import annotations

import io
import warnings
from typing import Any

from sglang_tpu_qwen.multimodal.errors import ImageInputError
from sglang_tpu_qwen.multimodal.media_limits import MediaLimits

# The formats served and their signatures; Pillow opens only the plugin the signature names.
_SERVED = (("PNG", b"\x89PNG\r\n\x1a\n"), ("JPEG", b"\xff\xd8\xff"))
# Known formats that are refused by name (their signatures), so the message says what was sent.
_REFUSED = (("GIF", b"GIF8"), ("BMP", b"BM"), ("TIFF", b"II*\x00"), ("TIFF", b"MM\x00*"), ("ICO", b"\x00\x00\x01\x00"),
            ("PDF", b"%PDF"), ("SVG", b"<svg"), ("SVG", b"<?xml"))  # fmt: skip


def image_format(data: bytes) -> str:
    """The served format ("PNG", "JPEG", "WEBP") that ``data`` starts with.

    Raises:
        ImageInputError: another known format (named), or no known signature.
    """
    for name, magic in _SERVED:
        if data.startswith(magic):
            return name
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WEBP"
    for name, magic in _REFUSED:
        if data.startswith(magic):
            raise ImageInputError(f"unsupported image format {name}: PNG, JPEG or WebP only")
    raise ImageInputError("the data is not a PNG, JPEG or WebP image (no image signature)")


# JPEG start-of-frame markers (baseline, progressive, lossless...): C0-CF except DHT (C4), JPG (C8), DAC (CC).
_JPEG_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}


def header_size(fmt: str, data: bytes) -> tuple[int, int] | None:
    """(width, height) as a PNG's IHDR or a JPEG's start-of-frame states them, read without Pillow (which does
    not open an image of zero width or height at all); None for WebP or a header not found."""
    if fmt == "PNG":
        if len(data) >= 24 and data[12:16] == b"IHDR":
            return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
        return None
    if fmt != "JPEG":
        return None
    i = 2  # past SOI; each segment is FF, a marker, then a big-endian length that counts itself
    while i + 4 <= len(data) and data[i] == 0xFF:
        marker = data[i + 1]
        if marker == 0xFF:  # a fill byte
            i += 1
            continue
        if marker in _JPEG_SOF:
            if i + 9 > len(data):
                return None
            return int.from_bytes(data[i + 7:i + 9], "big"), int.from_bytes(data[i + 5:i + 7], "big")
        if marker == 0xDA:  # start of scan: no frame header came first
            return None
        i += 2 + int.from_bytes(data[i + 2:i + 4], "big")
    return None


def decode_image(data: bytes, limits: MediaLimits) -> Any:
    """Decode an image fully (every pixel read now, so a truncated file fails here, not later).

    Args:
        data: the encoded image.
        limits: ``max_image_pixels`` is compared with the header's width x height before decoding.

    Returns:
        A loaded ``PIL.Image.Image`` in its own mode (RGB, RGBA, L, P...); the first frame of an animation.

    Raises:
        ImageInputError: an unsupported format, a header or pixel stream Pillow cannot read (corrupt or
            truncated), or more pixels than allowed.
    """
    from PIL import Image

    fmt = image_format(data)
    size = header_size(fmt, data)
    if size is not None and min(size) == 0:  # Pillow refuses these with "cannot identify image file"
        raise ImageInputError(f"the {fmt} image is {size[0]} x {size[1]} pixels: an image needs at least 1 x 1")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # our own limit applies below
            img = Image.open(io.BytesIO(data), formats=[fmt])
    except Image.DecompressionBombError as e:  # Pillow's own bound (2x MAX_IMAGE_PIXELS), checked in open
        raise _bomb(fmt, e, limits) from None
    except Exception as e:  # noqa: BLE001 (Pillow raises many types for a bad header)
        raise ImageInputError(f"could not decode the {fmt} image: {e}") from None
    width, height = img.size
    if width <= 0 or height <= 0:
        raise ImageInputError(f"the {fmt} image is {width} x {height} pixels: an image needs at least 1 x 1")
    if width * height > limits.max_image_pixels:
        raise ImageInputError(f"the {fmt} image is {width} x {height} = {width * height} pixels, above the limit "
                              f"of {limits.max_image_pixels} (--max-image-pixels)")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            img.load()
    except Image.DecompressionBombError as e:  # Pillow's own bound (2x MAX_IMAGE_PIXELS), checked in open
        raise _bomb(fmt, e, limits) from None
    except Exception as e:  # noqa: BLE001 (truncated data: OSError; a broken stream: SyntaxError, ValueError...)
        raise ImageInputError(f"could not decode the {fmt} image (corrupt or truncated): {e}") from None
    return img


def _bomb(fmt: str, error: Exception, limits: MediaLimits) -> ImageInputError:
    """The refusal of an image Pillow found beyond its decompression-bomb bound; ours is usually lower."""
    from PIL import Image

    bound = Image.MAX_IMAGE_PIXELS
    if bound is not None and limits.max_image_pixels <= 2 * bound:
        return ImageInputError(f"the {fmt} image has more than {2 * bound} pixels, above the limit of "
                               f"{limits.max_image_pixels} (--max-image-pixels)")
    return ImageInputError(f"the {fmt} image is too large to decode: {error}")
