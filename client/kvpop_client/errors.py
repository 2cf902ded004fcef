from kvpop_client.contract import ERROR_TAG_STATUS


class KVpopClientError(Exception):
    """Base class of everything this client raises."""


class KVpopServerError(KVpopClientError):
    """The server answered with an error (bad request, overload, internal failure)."""

    def __init__(self, message: str, status: str | None = None):
        super().__init__(message)
        self.status = status


class ResponseValidationError(KVpopClientError):
    """The server's answer is not what the KVpop API promises (types, shapes, counts)."""



def status_from_message(message: str, default: str | None = None) -> str | None:
    for tag, status in ERROR_TAG_STATUS.items():
        if tag in message[: len(tag) + 200]:
            return status
    return default
