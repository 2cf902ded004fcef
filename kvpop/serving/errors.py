"""Error kinds shared by both models, the front end and the client.

Triton's gRPC stream delivers a model's error as a bare message, without the error code the model set
(HTTP gets the code as its status). So every error the engine sends starts with a short, readable tag
naming its kind; the front end maps the tag back to the right Triton code (400 / INVALID_ARGUMENT,
503 / UNAVAILABLE, 500 / INTERNAL) and the client to a status, on every transport.
"""

from __future__ import annotations

# kind -> the tag that starts the message (kept human-readable: it is what curl users see).
ERROR_TAGS: dict[str, str] = {
    "invalid": "invalid argument: ",
    "overloaded": "unavailable: ",
    "internal": "internal: ",
}
# kind -> the gRPC status name the client reports (HTTP: 400, 503, 500).
ERROR_STATUS: dict[str, str] = {"invalid": "INVALID_ARGUMENT", "overloaded": "UNAVAILABLE", "internal": "INTERNAL"}


def tagged(kind: str, message: str) -> str:
    """The message with its kind's tag in front (once)."""
    tag = ERROR_TAGS[kind]
    return message if message.startswith(tag) else tag + message


def kind_of(message: str) -> str:
    """The kind a tagged message names; untagged messages are internal errors."""
    for kind, tag in ERROR_TAGS.items():
        if tag in message[: len(tag) + 200]:  # Triton may put the model's name in front
            return kind
    return "internal"
