"""Exception types shared by the layers of the package (grammar, engine, server); imports nothing of it."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request the engine cannot serve as sent (bad ids, bad sampling values, too long, bad grammar).

    The message is meant for the client: the HTTP server answers it as a 400.
    """
