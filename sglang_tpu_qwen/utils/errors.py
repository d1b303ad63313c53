"""Exception types shared by the layers of the package (grammar, engine, server); imports nothing of it."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request the engine cannot serve as sent (bad ids, bad sampling values, too long, bad grammar).

    The message is meant for the client: the HTTP server answers it as a 400.
    """

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
