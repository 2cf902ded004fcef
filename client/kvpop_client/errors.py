class KVpopClientError(Exception):
    """Base class of everything this client raises."""


class KVpopServerError(KVpopClientError):
    """The server answered with an error (bad request, overload, internal failure)."""

    def __init__(self, message: str, status: str | None = None):
        super().__init__(message)
        self.status = status


class ResponseValidationError(KVpopClientError):
    """The server's answer is not what the KVpop API promises (types, shapes, counts)."""
