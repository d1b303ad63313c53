"""The error of a bad image input."""

from __future__ import annotations

from sglang_tpu_qwen.engine.io.errors import InvalidRequestError


class ImageInputError(InvalidRequestError):
    """An image the server refuses: a bad reference, undecodable bytes, a limit exceeded, or a model that takes no
    images. The HTTP layer answers it with a 400 carrying the message (it is an ``InvalidRequestError``)."""
