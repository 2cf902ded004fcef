"""Multi-turn sessions: a finished sequence's cache kept across turns in hot / warm / cold tiers."""

from kvpop.sessions.checkpoint import CheckpointError, read_checkpoint, write_checkpoint
from kvpop.sessions.fingerprint import model_fingerprint
from kvpop.sessions.ids import MAX_SESSION_ID_LENGTH, InvalidSessionId, SessionKey, validate_session_id
from kvpop.sessions.state import SessionState
from kvpop.sessions.limits import COLD, HOT, TIERS, WARM, TierLimits
from kvpop.sessions.store import SessionStore

__all__ = [
    "COLD", "HOT", "MAX_SESSION_ID_LENGTH", "TIERS", "WARM", "CheckpointError", "InvalidSessionId",
    "SessionKey", "SessionState", "SessionStore", "TierLimits", "model_fingerprint",
    "read_checkpoint", "validate_session_id", "write_checkpoint",
]
