"""Python client for the KVpop Triton text-generation service."""

from kvpop_client.client import KVpopClient, Session, new_session_id
from kvpop_client.errors import KVpopClientError, KVpopServerError, ResponseValidationError
from kvpop_client.types import FINISH_REASONS, Generation, StreamChunk

__all__ = [
    "FINISH_REASONS",
    "Generation",
    "KVpopClient",
    "KVpopClientError",
    "KVpopServerError",
    "ResponseValidationError",
    "Session",
    "StreamChunk",
    "new_session_id",
]
