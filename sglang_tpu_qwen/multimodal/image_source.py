"""An image reference to its encoded bytes: a ``data:`` URL, a bare base64 string, a local file, an http(s) URL.

The forms SGLang's ``image_data`` and OpenAI's ``image_url.url`` take. Local files are read only under
``--allowed-local-media-path`` (vLLM's rule) and remote URLs fetched only from ``--allowed-media-domains``
(SGLang's and vLLM's flag); with neither flag a request can only send the image itself. Sizes are checked before
the bytes are held: a base64 string by its length, a file by its size, a download as it arrives.
"""

from __future__ import annotations

import base64
import binascii
import os
import re
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from sglang_tpu_qwen.multimodal.errors import ImageInputError
from sglang_tpu_qwen.multimodal.media_limits import MediaLimits

# Signatures of the formats served (image_decode.py reads them again to choose the decoder).
_IMAGE_MAGIC = (b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff", b"RIFF")
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):")
_WHITESPACE = re.compile(r"\s+")
_FETCH_CHUNK = 1 << 16


def read_image_bytes(ref: Any, limits: MediaLimits) -> bytes:
    """The encoded bytes an image reference names.

    Args:
        ref: a ``data:[<type>];base64,<data>`` URL, a bare base64 string, an absolute path or ``file://`` URL
            under the allowed directory, or an ``http(s)://`` URL of an allowed domain.
        limits: the operator's rules.

    Returns:
        The encoded image (at most ``limits.max_file_bytes`` bytes), not yet checked to be an image.

    Raises:
        ImageInputError: a reference of no known form, bad base64, a path or URL the rules refuse, a file or
            download that is missing, unreadable or too large.
    """
    if not isinstance(ref, str) or not ref.strip():
        raise ImageInputError("an image reference must be a non-empty string (a data: URL, base64, a path or a URL)")
    ref = ref.strip()
    low = ref[:16].lower()
    if low.startswith("data:"):
        return _data_url(ref, limits)
    if low.startswith(("http://", "https://")):
        return _fetch(ref, limits)
    if low.startswith("file:"):
        parsed = urllib.parse.urlparse(ref)
        if parsed.netloc not in ("", "localhost"):
            raise ImageInputError(f"file: URL with host {parsed.netloc!r}: only local files (file:///path)")
        return _local_file(urllib.parse.unquote(parsed.path), limits)
    if ref.startswith("/"):
        # A JPEG's base64 starts with "/9j/": a string that decodes to an image signature is data, not a path.
        data = _b64decode(ref, limits, strict=False)
        if data is not None and data.startswith(_IMAGE_MAGIC):
            return data
        return _local_file(ref, limits)
    match = _SCHEME.match(ref)
    if match and "://" in ref[:32]:
        raise ImageInputError(f"unsupported image URL scheme {match.group(1)!r}: use a data: URL, base64, "
                              "a file path or an http(s) URL")
    try:
        data = _b64decode(ref, limits, strict=True)
    except ImageInputError as e:
        raise ImageInputError(f"{e} (the reference is not a data: URL, an http(s) or file: URL or an absolute "
                              "path, so it was read as base64)") from None
    assert data is not None
    return data


def _data_url(ref: str, limits: MediaLimits) -> bytes:
    """The payload of a base64 ``data:`` URL."""
    head, sep, payload = ref.partition(",")
    if not sep:
        raise ImageInputError("invalid data: URL: no ',' before the data")
    params = [p.strip().lower() for p in head[5:].split(";")]
    if "base64" not in params[1:]:
        raise ImageInputError("invalid data: URL: only base64 data is accepted (data:image/png;base64,...)")
    media_type = params[0]
    if media_type and not media_type.startswith("image/"):
        raise ImageInputError(f"invalid data: URL: media type {media_type!r} is not an image")
    data = _b64decode(payload, limits, strict=True)
    assert data is not None
    return data


def _b64decode(text: str, limits: MediaLimits, strict: bool) -> bytes | None:
    """Base64 (standard or URL-safe alphabet, whitespace ignored) decoded; the size is checked from the length
    first. strict: bad base64 raises; otherwise it returns None."""
    text = _WHITESPACE.sub("", text)
    if len(text) // 4 * 3 > limits.max_file_bytes:
        raise ImageInputError(f"image data is about {len(text) // 4 * 3} bytes, above the limit of "
                              f"{limits.max_file_bytes} bytes (--media-url-max-file-size-mb)")
    if "-" in text or "_" in text:
        text = text.replace("-", "+").replace("_", "/")
    try:
        data = base64.b64decode(text + "=" * (-len(text) % 4), validate=True)
    except (binascii.Error, ValueError) as e:
        if not strict:
            return None
        raise ImageInputError(f"invalid base64 image data: {e}") from None
    if not data:
        if not strict:
            return None
        raise ImageInputError("invalid base64 image data: it decodes to no bytes")
    return data


def _local_file(path: str, limits: MediaLimits) -> bytes:
    """A file under the allowed directory (symlinks resolved first, so none leads out of it)."""
    root = limits.allowed_local_media_path
    if root is None:
        raise ImageInputError("local image files are not allowed: the server was started without "
                              "--allowed-local-media-path")
    if not os.path.isabs(path):
        raise ImageInputError("a local image path must be absolute (or a file:///path URL)")
    real = os.path.realpath(path)
    if os.path.commonpath([real, root]) != root:
        # Says nothing of whether the file exists: a client may not probe the file system outside the directory.
        raise ImageInputError(f"image path {path!r} is outside the directory the server allows "
                              "(--allowed-local-media-path)")
    if os.path.isdir(real):
        raise ImageInputError(f"image path {path!r} is a directory")
    if os.path.exists(real) and not os.path.isfile(real):  # a FIFO or device would block or never end
        raise ImageInputError(f"image path {path!r} is not a regular file")
    try:
        with open(real, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > limits.max_file_bytes:
                raise ImageInputError(f"image file {path!r} is {size} bytes, above the limit of "
                                      f"{limits.max_file_bytes} bytes (--media-url-max-file-size-mb)")
            return f.read(limits.max_file_bytes + 1)[: limits.max_file_bytes]
    except FileNotFoundError:
        raise ImageInputError(f"no image file at {path!r}") from None
    except OSError as e:
        raise ImageInputError(f"could not read image file {path!r}: {e.strerror or e}") from None


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """Refuse redirects: a redirect could lead out of the allowed domains."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # noqa: ANN001, ANN201 (urllib's signature)
        raise ImageInputError(f"image URL answered a redirect ({code}); redirects are not followed")


def _fetch(url: str, limits: MediaLimits) -> bytes:
    """An http(s) URL's body, from an allowed domain only, at most max_file_bytes."""
    parsed = urllib.parse.urlparse(url)
    host = (parsed.hostname or "").lower().rstrip(".")
    if not limits.allowed_media_domains:
        raise ImageInputError("remote image URLs are not allowed: send the image as a data: URL or base64 "
                              "(the server fetches URLs only from --allowed-media-domains)")
    if host not in limits.allowed_media_domains:
        raise ImageInputError(f"image URL domain {host!r} is not allowed (--allowed-media-domains)")
    opener = urllib.request.build_opener(_NoRedirect())
    request = urllib.request.Request(url, headers={"User-Agent": "sglang-tpu-qwen"})
    try:
        with opener.open(request, timeout=limits.fetch_timeout_s) as reply:
            length = reply.headers.get("Content-Length")
            if length is not None and length.isdigit() and int(length) > limits.max_file_bytes:
                raise ImageInputError(f"image URL body is {length} bytes, above the limit of "
                                      f"{limits.max_file_bytes} bytes (--media-url-max-file-size-mb)")
            chunks, total = [], 0
            while chunk := reply.read(_FETCH_CHUNK):
                total += len(chunk)
                if total > limits.max_file_bytes:
                    raise ImageInputError(f"image URL body is over the limit of {limits.max_file_bytes} bytes "
                                          "(--media-url-max-file-size-mb)")
                chunks.append(chunk)
            return b"".join(chunks)
    except ImageInputError:
        raise
    except urllib.error.HTTPError as e:
        raise ImageInputError(f"could not fetch image URL: HTTP {e.code}") from None
    except (urllib.error.URLError, OSError, ValueError) as e:
        reason = getattr(e, "reason", None) or e
        raise ImageInputError(f"could not fetch image URL: {reason}") from None
