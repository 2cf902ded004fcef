"""The tiered session store: hot (instance memory, counted in the KV pool), warm (host memory), cold
(checkpoint files), each bounded by its own byte limit.

Why three tiers and not one dict: a bounded cache makes a session small and fixed in size, so many
can be kept, but memory for running sequences comes first. A new or continued session enters the
hot tier; when a tier is over its limit its least recently used sessions (`evict_policy`) move one
tier down (hot -> warm -> cold) and a session read from a lower tier moves back up to hot. Cold
files older than `cold_ttl_s`, then the oldest beyond `cold_bytes`, are deleted.

When checkpoints are written: with `write_through` (the default) every `put` -- the end of every
turn -- also queues the session's checkpoint; the memory tiers are then caches of the disk and
demoting from warm only drops the copy. Without it, a session is queued for the disk only when it
is demoted from warm (a crash loses what was in memory). Either way the write itself happens on the
store's writer thread (`kvpop.sessions.writer`), never on the engine's step thread: a session whose
write is still pending is served from that pending copy, never from an older file; `close` (model
finalize) flushes every pending write, so only a SIGKILL within the time one write takes (tens to
hundreds of milliseconds) loses that one turn's checkpoint (the session goes on from its previous one).

Every id is validated and hashed with a keyed HMAC before it is a key or a file name; the secret is
kept beside the checkpoints (`session.key`, mode 0600) so it survives restarts. Several instances
may share one checkpoint directory: a miss in memory always looks on disk.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from kvpop.sessions.checkpoint import SUFFIX, CheckpointError, read_checkpoint
from kvpop.sessions.limits import COLD, HOT, WARM, StoreCounters, TierLimits
from kvpop.sessions.evict_policy import LRUPolicy
from kvpop.sessions.ids import SessionKey
from kvpop.sessions.state import SessionState
from kvpop.sessions.writer import CheckpointWriter, WriteOutcome

SECRET_FILE = "session.key"
log = logging.getLogger(__name__)


@dataclass
class _Entry:
    state: SessionState
    nbytes: int
    last_access: int
    hits: int = 0
    disk_stamp: int | None = None  # st_mtime_ns of the checkpoint this copy was written as


class SessionStore:
    def __init__(self, limits: TierLimits, fingerprint: str, secret: bytes | None = None, policy=None, clock=time.time,
                 on_queue_change: Callable[[int], None] | None = None) -> None:
        self.limits = limits
        # Told the number of pending checkpoint writes whenever it changes, from either thread: a gauge
        # read only on engine steps would stay stale once the server is idle.
        self.on_queue_change = on_queue_change
        self.fingerprint = fingerprint
        self.policy = policy or LRUPolicy()
        self.clock = clock
        self.counters = StoreCounters()
        self._lock = threading.Lock()
        self._tiers: dict[str, dict[str, _Entry]] = {HOT: {}, WARM: {}}
        self._tick = 0
        if limits.cold_dir is not None:
            Path(limits.cold_dir).mkdir(parents=True, exist_ok=True)
        self.secret = secret if secret is not None else self._load_secret()
        self._writer = CheckpointWriter(self._path, self._written, limits.checkpoint_queue) if limits.cold_dir is not None else None
        # The cold tier's (entries, bytes), from the directory scan that follows every write on the
        # writer thread, so `stats` (read by the metrics on the step thread) never scans the disk.
        files = self._cold_files()
        self._cold_stats = (len(files), sum(size for _, size, _ in files))

    # -- keys and paths -------------------------------------------------------------------------

    def _load_secret(self) -> bytes:
        if self.limits.cold_dir is None:
            return secrets.token_bytes(32)
        path = Path(self.limits.cold_dir) / SECRET_FILE
        try:
            descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            secret = path.read_bytes()
            if len(secret) != 32:
                raise ValueError(f"{path} is not a 32-byte session secret") from None
            return secret
        secret = secrets.token_bytes(32)
        with os.fdopen(descriptor, "wb") as handle:
            handle.write(secret)
        return secret

    def key(self, session_id: str) -> str:
        """The keyed hash of a (validated) id; raises InvalidSessionId."""
        return SessionKey.of(session_id, self.secret).digest

    def _path(self, digest: str) -> Path | None:
        return None if self.limits.cold_dir is None else Path(self.limits.cold_dir) / f"{digest}{SUFFIX}"

    # -- public API -----------------------------------------------------------------------------

    def get(self, session_id: str) -> SessionState | None:
        """The session's state, moved up to the hot tier; None when absent (or its checkpoint refused).
        The caller must not modify it (restoring copies its arrays)."""
        return self.lookup(session_id)[0]

    def lookup(self, session_id: str) -> tuple[SessionState | None, str | None]:
        """(state, the tier it was found in) as `get`; (None, None) when absent. A session whose
        checkpoint is still being written counts as cold and is served from the pending copy."""
        digest = self.key(session_id)
        with self._lock:
            self.counters.lookups += 1
            for tier in (HOT, WARM):
                entry = self._tiers[tier].pop(digest, None)
                if entry is not None and entry.disk_stamp is None and self._writer is not None:
                    entry.disk_stamp = self._writer.landed(digest, entry.state)  # written, not yet recorded
                if entry is not None and entry.disk_stamp is not None and entry.disk_stamp != self._stamp(digest):
                    entry = None  # the checkpoint changed (another instance's newer turn, or damage): read it
                if entry is not None:
                    self.counters.hits[tier] += 1
                    self.counters.promotions += tier != HOT
                    entry.hits += 1
                    self._insert(HOT, digest, entry)
                    self._enforce_limits()
                    return entry.state, tier
            state = self._writer.pending(digest) if self._writer is not None else None
            stamp = None  # a pending copy is newer than any file: the writer stamps it once written
            if state is None:
                state = self._read_cold(digest)
                stamp = self._stamp(digest)
            if state is None:
                return None, None
            self.counters.hits[COLD] += 1
            self.counters.promotions += 1
            self._insert(HOT, digest, _Entry(state, state.nbytes, 0, hits=1, disk_stamp=stamp))
            self._enforce_limits()
            return state, COLD

    def put(self, session_id: str, state: SessionState) -> None:
        """Keep `state` as the session's newest (hot tier; its checkpoint too with write_through,
        queued for the writer thread). Waits only while the writer is `checkpoint_queue` writes behind."""
        digest = self.key(session_id)
        if self._writer is not None:
            self._writer.wait_for_room()  # outside the lock: the writer thread takes it when a write ends
        with self._lock:
            for tier in (HOT, WARM):
                self._tiers[tier].pop(digest, None)
            if self.limits.write_through:
                self._write_cold(digest, state)
            self._insert(HOT, digest, _Entry(state, state.nbytes, 0))
            self._enforce_limits()

    def remove(self, session_id: str) -> bool:
        """Forget the session everywhere (memory, pending write and disk); whether it existed."""
        digest = self.key(session_id)
        with self._lock:
            found = any(self._tiers[tier].pop(digest, None) is not None for tier in (HOT, WARM))
            if self._writer is not None and self._writer.cancel(digest):
                found = True
                self._report_queue()
            path = self._path(digest)
            if path is not None and path.exists():
                self._unlink_cold(path)
                found = True
            return found

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued checkpoint is on disk (or failed); False on timeout."""
        return self._writer is None or self._writer.flush(timeout)

    def close(self, timeout: float | None = 30.0) -> bool:
        """Flush pending checkpoints and stop the writer thread (model finalize); False if some were
        left after `timeout`. The store stays usable: a later write starts the thread again."""
        return self._writer is None or self._writer.close(timeout)

    @property
    def checkpoint_queue(self) -> int:
        """Checkpoint writes pending (queued or being written)."""
        return 0 if self._writer is None else self._writer.depth

    def tier_of(self, session_id: str) -> str | None:
        digest = self.key(session_id)
        with self._lock:
            for tier in (HOT, WARM):
                if digest in self._tiers[tier]:
                    return tier
            if self._writer is not None and self._writer.pending(digest) is not None:
                return COLD  # on its way to the disk
            path = self._path(digest)
            return COLD if path is not None and path.exists() else None

    def stats(self) -> dict[str, dict[str, int]]:
        """Entries and bytes per tier. Cold: as of this store's last write or removal (another
        instance's new checkpoints count from this one's next write)."""
        with self._lock:
            result = {tier: {"entries": len(entries), "bytes": sum(entry.nbytes for entry in entries.values())}
                      for tier, entries in self._tiers.items()}
            result[COLD] = dict(zip(("entries", "bytes"), self._cold_stats))
            return result

    @property
    def hot_bytes(self) -> int:
        with self._lock:
            return sum(entry.nbytes for entry in self._tiers[HOT].values())

    def take_restore_seconds(self) -> list[float]:
        with self._lock:
            seconds, self.counters.restore_seconds = self.counters.restore_seconds, []
            return seconds

    def sweep(self) -> None:
        """Delete expired and excess checkpoints (also done after every write, on the writer thread)."""
        removed, totals = self._sweep_cold()
        with self._lock:
            self.counters.cold_removed += removed
            self._cold_stats = totals

    # -- tiers (called under the lock) ----------------------------------------------------------

    def _insert(self, tier: str, digest: str, entry: _Entry) -> None:
        self._tick += 1
        entry.last_access = self._tick
        self._tiers[tier][digest] = entry

    def _over(self, tier: str) -> bool:
        limit = self.limits.hot_bytes if tier == HOT else self.limits.warm_bytes
        return sum(entry.nbytes for entry in self._tiers[tier].values()) > limit

    def _enforce_limits(self) -> None:
        for tier, lower in ((HOT, WARM), (WARM, COLD)):
            entries = self._tiers[tier]
            while entries and self._over(tier):
                digest = min(entries, key=lambda d: self.policy.get_priority(entries[d]))
                entry = entries.pop(digest)
                self.counters.demotions += 1
                if lower == WARM:
                    entries_below = self._tiers[WARM]
                    entries_below[digest] = entry  # keeps its last_access: LRU order holds across tiers
                elif not self.limits.write_through:
                    self._write_cold(digest, entry.state)

    def _stamp(self, digest: str) -> int | None:
        path = self._path(digest)
        try:
            return None if path is None else path.stat().st_mtime_ns
        except FileNotFoundError:
            return None

    def _write_cold(self, digest: str, state: SessionState) -> None:
        if self._writer is not None:
            self._writer.submit(digest, state)
            self._report_queue()

    def _report_queue(self) -> None:
        if self.on_queue_change is not None:
            self.on_queue_change(self.checkpoint_queue)

    def _written(self, outcome: WriteOutcome) -> None:
        """A write ended (writer thread): count it, stamp the memory copy it came from, sweep the disk."""
        stored = outcome.error is None and not outcome.cancelled
        with self._lock:
            if stored:
                self._writer.landed(outcome.digest, outcome.state, take=True)
            self.counters.checkpoints_failed += outcome.error is not None
            self.counters.checkpoints_written += stored
            for tier in (HOT, WARM) if stored else ():
                entry = self._tiers[tier].get(outcome.digest)
                if entry is not None and entry.state is outcome.state:
                    entry.disk_stamp = outcome.stamp  # from now on a changed file wins over this copy
        self._report_queue()
        if stored:
            self.sweep()

    def _read_cold(self, digest: str) -> SessionState | None:
        path = self._path(digest)
        if path is None or not path.exists():
            return None
        started = time.perf_counter()
        try:
            state = read_checkpoint(path, owner=digest, fingerprint=self.fingerprint)
        except CheckpointError as error:
            log.warning("session checkpoint %s refused and deleted: %s", path.name, error)
            self.counters.checkpoints_rejected += 1
            self._unlink_cold(path)
            return None
        self.counters.restore_seconds.append(time.perf_counter() - started)
        os.utime(path)  # recently used: the last to expire or be removed for size
        return state

    def _unlink_cold(self, path: Path) -> None:
        """Delete one checkpoint (under the lock) and take it out of the cold tier's totals."""
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            return
        path.unlink(missing_ok=True)
        entries, total = self._cold_stats
        self._cold_stats = (max(entries - 1, 0), max(total - size, 0))

    def _cold_files(self) -> list[tuple[Path, int, float]]:
        """(path, bytes, mtime) of every checkpoint, oldest first."""
        if self.limits.cold_dir is None:
            return []
        files = []
        for path in Path(self.limits.cold_dir).glob(f"*{SUFFIX}"):
            if path.name.startswith(".tmp-"):
                continue
            try:
                info = path.stat()
            except FileNotFoundError:  # removed meanwhile (another instance)
                continue
            files.append((path, info.st_size, info.st_mtime))
        return sorted(files, key=lambda item: item[2])

    def _sweep_cold(self) -> tuple[int, tuple[int, int]]:
        """Delete expired checkpoints, then the oldest past `cold_bytes`: how many, and the (entries,
        bytes) left. Needs no lock (files only), so the writer thread's scan never holds up a lookup."""
        files = self._cold_files()
        now = self.clock()
        total = sum(size for _, size, _ in files)
        removed = 0
        for path, size, mtime in files:
            if now - mtime > self.limits.cold_ttl_s or total > self.limits.cold_bytes:
                path.unlink(missing_ok=True)
                total -= size
                removed += 1
        return removed, (len(files) - removed, total)
