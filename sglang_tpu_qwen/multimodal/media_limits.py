"""MediaLimits: the operator's rules for image inputs, from the launch flags."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from sglang_tpu_qwen.args.server_args import DEFAULT_IMAGES_PER_REQUEST


@dataclass(frozen=True)
class MediaLimits:
    """Where images may come from and how large they may be.

    Attributes:
        allowed_local_media_path: resolved directory (no symlinks) whose files requests may name; None: none.
        allowed_media_domains: host names (lower case) whose http(s) URLs are fetched; empty: no remote URL.
        max_file_bytes: largest encoded image in bytes (any source).
        max_images: most images in one request.
        max_image_pixels: largest width x height of a decoded image.
        fetch_timeout_s: seconds a remote fetch may take in all.
    """

    allowed_local_media_path: str | None = None
    allowed_media_domains: frozenset[str] = frozenset()
    max_file_bytes: int = 64 << 20
    max_images: int = DEFAULT_IMAGES_PER_REQUEST
    max_image_pixels: int = 2**25
    fetch_timeout_s: float = 10.0

    @classmethod
    def from_server_args(cls, args: Any) -> MediaLimits:
        """The limits of ServerArgs (`--allowed-local-media-path`, `--allowed-media-domains`,
        `--media-url-max-file-size-mb`, `--limit-mm-data-per-request`, `--max-image-pixels`); defaults for
        fields an args object lacks."""
        path = getattr(args, "allowed_local_media_path", None)
        domains = getattr(args, "allowed_media_domains", None) or ()
        limits = getattr(args, "limit_mm_data_per_request", None) or {}
        return cls(
            allowed_local_media_path=os.path.realpath(path) if path else None,
            allowed_media_domains=frozenset(d.strip().lower().rstrip(".") for d in domains if d.strip()),
            max_file_bytes=int(float(getattr(args, "media_url_max_file_size_mb", 64.0)) * (1 << 20)),
            max_images=int(limits.get("image", DEFAULT_IMAGES_PER_REQUEST)),
            max_image_pixels=int(getattr(args, "max_image_pixels", 2**25)),
        )
