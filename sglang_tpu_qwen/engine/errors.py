"""Errors the engine raises for requests it refuses (defined in sglang_tpu_qwen/errors.py, below grammar/)."""

from sglang_tpu_qwen.errors import InvalidRequestError

__all__ = ["InvalidRequestError"]
