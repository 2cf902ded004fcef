"""Checkpoint writes on the store's writer thread: pending copies are served, newer writes supersede
older ones, a removed session leaves nothing on disk, close flushes, and a failed write is logged and
counted without reaching the caller (the engine's step thread)."""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import numpy as np
import pytest

import kvpop.sessions.writer as writer_module
from kvpop.sessions import COLD, HOT, SessionStore, TierLimits, read_checkpoint
from sessions.test_session_store import FINGERPRINT, make_state


class GatedWrites:
    """Replaces the writer's `write_checkpoint`: records every write and holds each one at a gate
    until the test opens it, so a test can look at the store while a write is pending or in flight."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.real = writer_module.write_checkpoint
        self.open = threading.Event()
        self.started = threading.Semaphore(0)
        self.written: list[tuple[str, int]] = []  # (owner, tokens) in write order
        monkeypatch.setattr(writer_module, "write_checkpoint", self)

    def __call__(self, path: Path, state, owner: str) -> int:
        self.started.release()
        assert self.open.wait(30), "the test never opened the gate"
        self.written.append((owner, state.tokens_seen))
        return self.real(path, state, owner)

    def wait_started(self) -> None:
        assert self.started.acquire(timeout=30), "no write started"


def new_store(tmp_path: Path, hot: int = 1 << 30, warm: int = 0, on_queue_change=None, **options) -> SessionStore:
    limits = TierLimits(hot_bytes=hot, warm_bytes=warm, cold_dir=tmp_path / "cold", **options)
    return SessionStore(limits, FINGERPRINT, on_queue_change=on_queue_change)


def file_of(sessions: SessionStore, session_id: str) -> Path:
    return sessions.limits.cold_dir / f"{sessions.key(session_id)}.safetensors"


def tokens_on_disk(sessions: SessionStore, session_id: str) -> int:
    return read_checkpoint(file_of(sessions, session_id), sessions.key(session_id), FINGERPRINT).tokens_seen


def test_a_session_whose_write_is_pending_is_served_from_the_pending_copy_not_the_old_file(tmp_path, monkeypatch):
    _, old = make_state(tokens=40)
    _, new = make_state(tokens=60, seed=1)
    sessions = new_store(tmp_path, hot=0)  # nothing stays in memory: only the writer holds a copy
    sessions.put("a", old)
    assert sessions.flush(timeout=30) and tokens_on_disk(sessions, "a") == 40
    gate = GatedWrites(monkeypatch)
    sessions.put("a", new)
    gate.wait_started()  # in flight: the old file is still the one on disk
    assert sessions.tier_of("a") == COLD and sessions.checkpoint_queue == 1
    state, tier = sessions.lookup("a")
    assert state is new and tier == COLD  # the pending copy, not the older file
    assert sessions.take_restore_seconds() == []  # no disk read
    gate.open.set()
    assert sessions.flush(timeout=30) and tokens_on_disk(sessions, "a") == 60 and sessions.checkpoint_queue == 0


def test_a_newer_write_supersedes_a_pending_one(tmp_path, monkeypatch):
    states = [make_state(tokens=tokens, seed=tokens)[1] for tokens in (20, 30, 40, 50)]
    gate = GatedWrites(monkeypatch)
    sessions = new_store(tmp_path)
    sessions.put("other", states[0])
    gate.wait_started()  # "other" is in flight; the three turns of "a" queue behind it
    for state in states[1:]:
        sessions.put("a", state)
    assert sessions.checkpoint_queue == 2  # one pending write per session
    gate.open.set()
    assert sessions.flush(timeout=30)
    key_a, key_other = sessions.key("a"), sessions.key("other")
    assert gate.written == [(key_other, 20), (key_a, 50)]  # turns 30 and 40 of "a" never hit the disk
    assert tokens_on_disk(sessions, "a") == 50 and sessions.counters.checkpoints_written == 2
    state, tier = sessions.lookup("a")
    assert state is states[3] and tier == HOT  # the memory copy is stamped with the newest file


def test_a_newer_turn_during_a_write_is_written_after_it(tmp_path, monkeypatch):
    _, first = make_state(tokens=20)
    _, second = make_state(tokens=30, seed=1)
    gate = GatedWrites(monkeypatch)
    sessions = new_store(tmp_path)
    sessions.put("a", first)
    gate.wait_started()
    sessions.put("a", second)  # while the first turn's file is being written
    gate.open.set()
    assert sessions.flush(timeout=30)
    assert [tokens for _, tokens in gate.written] == [20, 30] and tokens_on_disk(sessions, "a") == 30


@pytest.mark.parametrize("in_flight", [False, True], ids=["queued", "in-flight"])
def test_removing_a_session_cancels_its_pending_write_and_leaves_no_file(tmp_path, monkeypatch, in_flight):
    _, state = make_state()
    gate = GatedWrites(monkeypatch)
    sessions = new_store(tmp_path)
    if not in_flight:
        sessions.put("other", state)  # holds the writer, so the write of "a" stays queued
        gate.wait_started()
    sessions.put("a", state)
    if in_flight:
        gate.wait_started()
        threading.Timer(0.2, gate.open.set).start()  # remove waits for the write in flight, then deletes it
    assert sessions.remove("a")
    assert sessions.tier_of("a") is None and sessions.get("a") is None and not file_of(sessions, "a").exists()
    gate.open.set()
    assert sessions.flush(timeout=30)
    assert not file_of(sessions, "a").exists() and sessions.get("a") is None
    assert not any(path.name.startswith(".tmp-") for path in (tmp_path / "cold").iterdir())
    assert [owner for owner, _ in gate.written].count(sessions.key("a")) == (1 if in_flight else 0)


def test_close_flushes_every_pending_write_and_a_restarted_store_finds_them(tmp_path, monkeypatch):
    states = {f"s{index}": make_state(tokens=20 + index, seed=index)[1] for index in range(5)}
    gate = GatedWrites(monkeypatch)
    queue_depths: list[int] = []  # what a kvpop_session_checkpoint_queue gauge would be set to
    sessions = new_store(tmp_path, hot=0, on_queue_change=queue_depths.append)
    for name, state in states.items():
        sessions.put(name, state)
    assert sessions.checkpoint_queue == 5 and queue_depths == [1, 2, 3, 4, 5]
    threading.Timer(0.2, gate.open.set).start()
    assert sessions.close(timeout=30)  # returns only once every write is on disk
    assert sessions.checkpoint_queue == 0 and len(gate.written) == 5 and queue_depths[5:] == [4, 3, 2, 1, 0]
    restarted = new_store(tmp_path, hot=0)
    for name, state in states.items():
        np.testing.assert_array_equal(restarted.get(name).tokens, state.tokens)
    sessions.put("after-close", states["s0"])  # still usable: a new writer thread starts
    assert sessions.close(timeout=30) and file_of(sessions, "after-close").exists()


def test_put_waits_for_the_disk_when_the_queue_is_full(tmp_path, monkeypatch):
    _, state = make_state()
    gate = GatedWrites(monkeypatch)
    sessions = new_store(tmp_path, checkpoint_queue=2)
    sessions.put("a", state)
    gate.wait_started()
    sessions.put("b", state)
    third = threading.Thread(target=sessions.put, args=("c", state))
    third.start()
    third.join(0.3)
    assert third.is_alive()  # two writes pending: the third put waits for room
    gate.open.set()
    third.join(30)
    assert not third.is_alive() and sessions.flush(timeout=30) and len(gate.written) == 3


def test_a_failed_write_is_logged_and_counted_and_the_session_stays_in_memory(tmp_path, monkeypatch, caplog):
    _, state = make_state()
    sessions = new_store(tmp_path)

    def disk_full(path, state, owner):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(writer_module, "write_checkpoint", disk_full)
    with caplog.at_level(logging.WARNING, logger="kvpop.sessions.writer"):
        sessions.put("a", state)  # the caller never sees the error
        assert sessions.flush(timeout=30)
    assert "No space left on device" in caplog.text
    assert sessions.counters.checkpoints_failed == 1 and sessions.counters.checkpoints_written == 0
    assert sessions.get("a") is state and not file_of(sessions, "a").exists()

    monkeypatch.undo()  # the writer thread survived: the next write succeeds
    sessions.put("a", state)
    assert sessions.flush(timeout=30) and file_of(sessions, "a").exists() and sessions.counters.checkpoints_written == 1


def test_a_write_refused_by_the_file_system_is_counted(tmp_path):
    _, state = make_state()
    sessions = new_store(tmp_path)
    file_of(sessions, "a").mkdir()  # a directory in the way: os.replace fails (as a permission error would)
    sessions.put("a", state)
    assert sessions.flush(timeout=30) and sessions.counters.checkpoints_failed == 1
    assert not any(path.name.startswith(".tmp-") for path in (tmp_path / "cold").iterdir())  # no temporary left
    assert sessions.get("a") is state


def test_step_thread_cost_of_a_put_does_not_include_the_write(tmp_path, monkeypatch):
    _, state = make_state()
    gate = GatedWrites(monkeypatch)  # every write blocks until the end of the test
    sessions = new_store(tmp_path, hot=0)
    for index in range(10):  # would hang here if put or a demotion wrote on the caller's thread
        sessions.put(f"s{index}", state)
    assert sessions.checkpoint_queue == 10 and gate.written == []
    gate.open.set()
    assert sessions.flush(timeout=30) and len(gate.written) == 10


def test_close_that_times_out_leaves_the_writer_finishing_its_writes(tmp_path, monkeypatch, caplog):
    _, state = make_state()
    gate = GatedWrites(monkeypatch)
    sessions = new_store(tmp_path)
    others = {thread for thread in threading.enumerate() if thread.name == "kvpop-checkpoints"}  # other tests' stores
    sessions.put("a", state)
    gate.wait_started()
    with caplog.at_level(logging.WARNING, logger="kvpop.sessions.writer"):
        assert not sessions.close(timeout=0.2)  # the disk hangs: shutdown does not wait forever
    assert "not yet written" in caplog.text
    sessions.put("b", state)  # queued behind it, written by the same thread
    gate.open.set()
    assert sessions.flush(timeout=30) and file_of(sessions, "a").exists() and file_of(sessions, "b").exists()
    assert sessions.close(timeout=30)
    assert {thread for thread in threading.enumerate() if thread.name == "kvpop-checkpoints"} <= others  # stopped


def test_tier_stats_never_scan_the_disk_on_the_callers_thread(tmp_path, monkeypatch):
    _, state = make_state()
    sessions = new_store(tmp_path, hot=0)
    scan = sessions._cold_files

    def writer_thread_only():
        assert threading.current_thread().name == "kvpop-checkpoints", "a directory scan on the step thread"
        return scan()

    monkeypatch.setattr(sessions, "_cold_files", writer_thread_only)
    for name in "abc":
        sessions.put(name, state)
    assert sessions.flush(timeout=30)
    size = file_of(sessions, "a").stat().st_size
    assert sessions.stats()[COLD] == {"entries": 3, "bytes": 3 * size}
    sessions.remove("a")  # counted out at once, without a scan
    data = file_of(sessions, "b").read_bytes()
    file_of(sessions, "b").write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))  # same size, bad checksum
    assert sessions.get("b") is None  # refused and deleted
    assert sessions.stats()[COLD] == {"entries": 1, "bytes": size}


def test_a_newer_file_from_another_instance_wins_even_before_the_writer_reports(tmp_path):
    _, mine = make_state(tokens=40)
    _, theirs = make_state(tokens=50, seed=1)
    sessions = new_store(tmp_path)
    other = new_store(tmp_path)  # another instance on the same checkpoint directory
    reported = threading.Event()
    report = sessions._writer._on_done
    sessions._writer._on_done = lambda outcome: (reported.wait(30), report(outcome))  # the store hears late
    sessions.put("a", mine)
    while sessions.checkpoint_queue:  # written (no longer pending), not yet reported to the store
        threading.Event().wait(0.01)
    path = file_of(sessions, "a")
    os.utime(path, ns=(path.stat().st_mtime_ns - 10**9,) * 2)  # coarse file-system clocks
    other.put("a", theirs)
    assert other.flush(timeout=30)
    assert sessions.get("a").tokens_seen == 50  # the memory copy is known to be older than the file
    reported.set()
    assert sessions.flush(timeout=30)
