"""Session ids: opaque strings from clients, validated, and never used as keys or file names as given.

A client's id is untrusted input. It is checked against a short allow-list (length and characters),
then turned into a keyed hash (HMAC-SHA256 under the store's secret) before it becomes a dict key
or a file name. The hash keeps ids out of paths (no traversal, no case or length games on the
file system), and the key keeps the mapping unpredictable: knowing a file name reveals nothing
about, and cannot be forged from, the id behind it.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from dataclasses import dataclass

MAX_SESSION_ID_LENGTH = 128
_ALLOWED = re.compile(r"[A-Za-z0-9_\-.:=+]+")  # uuids, base64url tokens, dotted names


class InvalidSessionId(ValueError):
    """The client's session id is not acceptable (empty, too long, or outside the allowed characters)."""


def validate_session_id(session_id: object) -> str:
    """The id unchanged if acceptable; raises InvalidSessionId (a ValueError) with the reason."""
    if not isinstance(session_id, str):
        raise InvalidSessionId(f"session_id must be a string, got {type(session_id).__name__}")
    if not session_id:
        raise InvalidSessionId("session_id is empty")
    if len(session_id) > MAX_SESSION_ID_LENGTH:
        raise InvalidSessionId(f"session_id is longer than {MAX_SESSION_ID_LENGTH} characters")
    if not _ALLOWED.fullmatch(session_id):
        raise InvalidSessionId("session_id may only contain letters, digits and _ - . : = +")
    return session_id


@dataclass(frozen=True)
class SessionKey:
    """The keyed hash of a validated session id: what the store and the disk see (64 hex digits)."""

    digest: str

    @classmethod
    def of(cls, session_id: str, secret: bytes) -> "SessionKey":
        validate_session_id(session_id)
        return cls(hmac.new(secret, session_id.encode("ascii"), hashlib.sha256).hexdigest())

    def __str__(self) -> str:
        return self.digest
