"""Errors the engine raises for requests it refuses."""


class InvalidRequestError(ValueError):
    """A request the engine cannot serve as sent (bad ids, bad sampling values, too long).

    The message is meant for the client: the HTTP server answers it as a 400.
    """
