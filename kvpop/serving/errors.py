"""Error messages that keep their kind on every transport (kvpop.serving.contract.ErrorKind says why)."""

from __future__ import annotations

from kvpop.serving.contract import ErrorKind


class InvalidRequestError(ValueError):
    """The request is malformed (ErrorKind.INVALID); the message is sent back to the client."""


def tagged(kind: ErrorKind | str, message: str) -> str:
    """The message with its kind's tag in front (once)."""
    tag = ErrorKind(kind).tag
    return message if message.startswith(tag) else tag + message


def kind_of(message: str) -> ErrorKind:
    """The kind a tagged message names; untagged messages are internal errors."""
    for kind in ErrorKind:
        if kind.tag in message[: len(kind.tag) + 200]:  # Triton may put the model's name in front
            return kind
    return ErrorKind.INTERNAL
