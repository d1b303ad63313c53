"""Errors the engine raises for requests it refuses or fails, and the failure finish_reason they come from.

InvalidRequestError is defined in sglang_tpu_qwen/utils/errors.py (below grammar/, which raises it too).
"""

from __future__ import annotations

from typing import Any

from sglang_tpu_qwen.utils.errors import InvalidRequestError

INTERNAL_ERROR = "InternalServerError"


class RequestFailedError(Exception):
    """A request the server failed (a step that raised, a dead or unhealthy scheduler), not the client's fault.

    Attributes:
        message: what failed, for the client (also `str(exc)`).
        status: HTTP status of the reply (500, or 503 while the server cannot serve at all).
        err_type: SGLang's error type name ("InternalServerError", "ServiceUnavailable").
    """

    def __init__(self, message: str, status: int = 500, err_type: str = INTERNAL_ERROR) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.err_type = err_type


def failure_reason(message: str, status: int = 500, err_type: str = INTERNAL_ERROR) -> dict[str, Any]:
    """The finish_reason of a request the server failed (SGLang's shape; docs/internals.md, "Failures")."""
    return {"type": "abort", "message": message, "status_code": status, "err_type": err_type}


def failed_status(reason: dict | None) -> int | None:
    """The HTTP status of a finish_reason that reports a failure (an abort with a status_code), else None.

    A client abort has no status_code and is not a failure: its reply is a normal one.
    """
    if not reason or reason.get("type") != "abort":
        return None
    status = reason.get("status_code")
    return int(status) if status is not None else None


__all__ = ["INTERNAL_ERROR", "InvalidRequestError", "RequestFailedError", "failed_status", "failure_reason"]
