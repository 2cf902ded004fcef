"""The drain signal from the supervisor to the engine: a file whose presence means "shutting down".

The supervisor (kvpop.serving.process.supervisor) writes it on SIGTERM with the grace deadline (Unix time)
inside; the engine then refuses new requests as UNAVAILABLE (clients retry on another replica) and,
once the deadline has passed, fails whatever is still running with a clear error instead of letting
the server cut it off. A file, because it is the one thing both processes see without a protocol.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

DRAIN_FILE_ENV = "KVPOP_DRAIN_FILE"


class DrainSignal:
    def __init__(self, path: str | os.PathLike | None = None) -> None:
        path = path if path is not None else os.environ.get(DRAIN_FILE_ENV)
        self.path = Path(path) if path else None
        self._deadline: float | None = None

    def start(self, grace_seconds: float) -> None:
        """Begin draining: the deadline is now + grace_seconds (written atomically)."""
        assert self.path is not None
        temporary = self.path.with_suffix(".tmp")
        temporary.write_text(f"{time.time() + grace_seconds:.3f}\n")
        temporary.replace(self.path)

    def clear(self) -> None:
        if self.path is not None:
            self.path.unlink(missing_ok=True)
        self._deadline = None

    @property
    def draining(self) -> bool:
        return self.path is not None and self.path.exists()

    def deadline_passed(self) -> bool:
        """Whether the grace period is over (False when not draining)."""
        if not self.draining:
            self._deadline = None
            return False
        if self._deadline is None:
            try:
                self._deadline = float(self.path.read_text().strip() or 0)
            except (OSError, ValueError):
                self._deadline = 0.0  # unreadable: treat as due
        return time.time() >= self._deadline
