"""Checkpoint writes off the engine's step thread: one background thread, a bounded set of pending
writes, each written atomically (`write_checkpoint`: temp file, fsync, `os.replace`).

Why a dict and not a FIFO queue: only a session's newest state matters, so a newer write of the same
session replaces the pending one in place (it keeps its turn in line) and the disk never sees the
older one. A pending state stays readable here (`pending`) until its file is in place, so the store
can serve it instead of a stale or missing file; `cancel` drops it, and if it is being written right
now waits for the rename to land and deletes the file. Writes go out oldest first.

The thread starts on the first write and stops in `close`, which first waits for every pending write
(model finalize, drain), so a clean shutdown never loses a turn; only a SIGKILL can, and then only the
writes still pending (see the README's sessions section).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from kvpop.sessions.checkpoint import write_checkpoint
from kvpop.sessions.state import SessionState

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WriteOutcome:
    """What became of one write, reported to the store from the writer thread."""

    digest: str
    state: SessionState
    stamp: int | None  # st_mtime_ns of the file written; None when the write failed or was cancelled
    error: Exception | None = None
    cancelled: bool = False


class CheckpointWriter:
    def __init__(self, path_of: Callable[[str], Path], on_done: Callable[[WriteOutcome], None], max_pending: int) -> None:
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending}")
        self._path_of, self._on_done, self.max_pending = path_of, on_done, max_pending
        self._condition = threading.Condition()
        self._pending: OrderedDict[str, SessionState] = OrderedDict()  # digest -> newest state, oldest first
        self._writing: str | None = None  # the digest being written now (still in _pending)
        self._cancelled = False  # the write in progress was cancelled: delete its file once it lands
        self._reporting = False  # the store is being told about a finished write (flush waits for it)
        # digest -> (state, st_mtime_ns) of writes that landed and the store has not taken yet: set in
        # the same step that ends the write's pending state, so a copy is never neither pending nor stamped.
        self._landed: dict[str, tuple[SessionState, int]] = {}
        self._thread: threading.Thread | None = None
        self._stopping = False

    # -- called by the store (any thread) ----------------------------------------------------------

    def submit(self, digest: str, state: SessionState) -> None:
        """Queue `state` as the session's checkpoint, superseding a pending one. Never blocks: the
        bound is kept by `wait_for_room`, which callers use before they change anything."""
        with self._condition:
            self._pending[digest] = state
            if self._writing == digest:
                self._cancelled = False  # a newer state follows; the older file is replaced by it
            self._start_locked()
            self._condition.notify_all()

    def pending(self, digest: str) -> SessionState | None:
        """The state queued (or being written) for `digest`: newer than its file, if any."""
        with self._condition:
            return self._pending.get(digest)

    def landed(self, digest: str, state: SessionState, take: bool = False) -> int | None:
        """The mtime of the file `state` was written as, once written (None before, or for another
        state of the session); `take` forgets it (the store has recorded it)."""
        with self._condition:
            found = self._landed.get(digest)
            if found is None or found[0] is not state:
                return None
            if take:
                del self._landed[digest]
            return found[1]

    def cancel(self, digest: str) -> bool:
        """Forget a pending write; whether one was pending. A write of `digest` in progress is waited
        for (one file write) and its file deleted, so nothing of the session is left on disk after."""
        with self._condition:
            found = self._pending.pop(digest, None) is not None
            if self._writing == digest:
                self._cancelled = True
                self._condition.wait_for(lambda: self._writing != digest)
            return found

    def wait_for_room(self, timeout: float | None = None) -> bool:
        """Block while `max_pending` writes are pending (the disk is slower than the turns)."""
        with self._condition:
            return self._condition.wait_for(lambda: len(self._pending) < self.max_pending, timeout)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every pending write is on disk (or failed) and the store knows; False on timeout."""
        with self._condition:
            return self._condition.wait_for(lambda: not self._pending and not self._reporting, timeout)

    def close(self, timeout: float | None = 30.0) -> bool:
        """Flush, then stop the thread (a later `submit` starts a new one). False if writes were still
        pending after `timeout`; the thread then goes on with them and stops when none is left."""
        flushed = self.flush(timeout)
        with self._condition:
            thread = self._thread
            if thread is not None:
                self._stopping = True
                self._condition.notify_all()
            if not flushed:
                log.warning("%d session checkpoint(s) not yet written at shutdown", len(self._pending))
        if thread is not None and flushed:
            thread.join(timeout)
        return flushed

    @property
    def depth(self) -> int:
        with self._condition:
            return len(self._pending)

    # -- the writer thread -------------------------------------------------------------------------

    def _start_locked(self) -> None:
        if self._thread is None and not self._stopping:
            self._thread = threading.Thread(target=self._run, name="kvpop-checkpoints", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            with self._condition:
                self._condition.wait_for(lambda: self._pending or self._stopping)
                if not self._pending:  # stopping and nothing left: the next submit starts a new thread
                    self._thread, self._stopping = None, False
                    return
                digest, state = next(iter(self._pending.items()))
                self._writing, self._cancelled = digest, False
            outcome = self._write(digest, state)
            with self._condition:
                if self._cancelled:
                    self._path_of(digest).unlink(missing_ok=True)  # removed while it was being written
                    outcome = WriteOutcome(digest, state, None, outcome.error, cancelled=True)
                elif outcome.stamp is not None:
                    self._landed[digest] = (state, outcome.stamp)
                if self._pending.get(digest) is state:  # not superseded or cancelled meanwhile
                    del self._pending[digest]
                self._writing, self._reporting = None, True
                self._condition.notify_all()
            try:  # without this lock: the store's lock is taken here, and the store calls in under it
                self._on_done(outcome)
            except Exception:  # the store's bookkeeping must not stop later writes
                log.exception("session checkpoint bookkeeping failed")
            with self._condition:
                self._reporting = False
                self._condition.notify_all()

    def _write(self, digest: str, state: SessionState) -> WriteOutcome:
        path = self._path_of(digest)
        try:
            stamp = write_checkpoint(path, state, owner=digest).st_mtime_ns
        except Exception as error:  # a full disk, a permission: counted and logged, the turn is not failed
            log.warning("session checkpoint %s not written: %s", path.name, error)
            return WriteOutcome(digest, state, None, error)
        return WriteOutcome(digest, state, stamp)
