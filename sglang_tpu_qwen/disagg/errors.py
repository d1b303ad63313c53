"""The one exception type of a failed transfer, carrying the HTTP status the waiting request gets."""

from __future__ import annotations


class TransferError(Exception):
    """A transfer that cannot complete: a prefill-side rejection, a layout mismatch, a lost peer, a timeout.

    Attributes:
        status: HTTP status for the request that waited on the transfer (400 for a rejection of the
            request itself, 500 for a mismatch or a lost/timed-out peer).
        message: human-readable reason (also `str(exc)`).
    """

    def __init__(self, message: str, status: int = 500) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
