"""Triton's Python backend stubs: which belong to a server, which outlived theirs, their shared memory.

A stub (`triton_python_backend_stub <model.py> <shm region> ...`) is a child of tritonserver in the
server's process group. When the server dies without unloading its models (SIGKILL, a crash, the
supervisor killed with it), the stub is meant to notice and exit, but one that was answering a request
waits forever on the dead server's shared-memory queue (measured: a `kvpop_service` stub still alive
minutes later with 62 MB and its /dev/shm region, every Python thread blocked behind one that holds
the GIL in `Metric.set`). So
- the server side finds a dead server's stubs by its process group (which outlives the server) and
  kills them before it starts a new server (`TritonServer.start`, `stop`), and also kills stubs of its
  model repository whose server is gone (a server killed together with its supervisor);
- the stub side (`exit_with_server`, started by each model) runs a watcher process beside each stub
  that kills it a few seconds after its server is gone, when the stub's own exit did not happen, and
  removes its region.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

STUB_BINARY = "triton_python_backend_stub"
SERVER_BINARY = "tritonserver"
SHM_DIR = Path("/dev/shm")


@dataclass(frozen=True)
class StubProcess:
    pid: int
    model: str  # e.g. kvpop_engine (from the stub's model.py path)
    shm_region: str  # its shared-memory region name in /dev/shm
    model_file: str = ""  # the model.py it runs: <repository>/<model>/<version>/model.py

    @classmethod
    def from_process(cls, process: psutil.Process) -> "StubProcess | None":
        try:
            command = process.cmdline()
        except psutil.Error:
            return None
        if not command or not command[0].endswith(STUB_BINARY) or len(command) < 3:
            return None
        return cls(process.pid, Path(command[1]).parent.parent.name, command[2], command[1])

    def is_alive(self) -> bool:
        try:
            return psutil.Process(self.pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False


def _all_stubs() -> list[tuple[StubProcess, psutil.Process]]:
    found = []
    for process in psutil.process_iter():
        stub = StubProcess.from_process(process)
        if stub is not None:
            found.append((stub, process))
    return found


def stub_processes(server_pid: int) -> list[StubProcess]:
    """The stubs of the server `server_pid` (the leader of its process group), alive or not yet reaped;
    found by the group, so also once the server itself is gone."""
    stubs = []
    for stub, _ in _all_stubs():
        try:
            if os.getpgid(stub.pid) == server_pid:
                stubs.append(stub)
        except ProcessLookupError:
            pass
    return stubs


def orphaned_stubs(model_repository: Path) -> list[StubProcess]:
    """Stubs running a model of `model_repository` whose parent is no tritonserver any more."""
    repository = Path(model_repository).resolve()
    orphans = []
    for stub, process in _all_stubs():
        try:
            parent = process.parent()
            served = parent is not None and parent.name() == SERVER_BINARY and parent.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            served = False
        if not served and Path(stub.model_file).resolve().is_relative_to(repository):
            orphans.append(stub)
    return orphans


def kill_stubs(stubs: list[StubProcess]) -> None:
    """SIGKILL `stubs` (a stub that lost its server ignores SIGTERM) and remove their /dev/shm regions."""
    for stub in stubs:
        try:
            os.kill(stub.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for stub in stubs:
        try:
            psutil.Process(stub.pid).wait(5)
        except (psutil.NoSuchProcess, psutil.TimeoutExpired):
            pass
    remove_shm_regions([stub.shm_region for stub in stubs])


def remove_shm_regions(regions: list[str]) -> None:
    """Remove Python-backend shared-memory regions (a stub that did not exit cleanly leaves its region behind)."""
    for region in regions:
        for path in SHM_DIR.glob(f"{region}*"):
            path.unlink(missing_ok=True)


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def exit_with_server() -> subprocess.Popen | None:
    """Inside a stub (a model's `initialize`): start its watcher, a small process that SIGKILLs the stub
    and removes its region a few seconds after the server is gone, if the stub has not exited by then.
    A process, not a thread: a stub whose server died mid-request can hang holding the GIL (measured:
    `Metric.set` waiting forever on the dead server's queue), where no thread of its own would ever run
    again. None outside a stub."""
    this = StubProcess.from_process(psutil.Process())
    if this is None:
        return None
    python = shutil.which("python3") or sys.executable
    # This file as an isolated script (-I: nothing beside it on sys.path): psutil alone, not the kvpop package.
    return subprocess.Popen([python, "-I", __file__, str(os.getppid()), str(this.pid), this.shm_region],
                            stdin=subprocess.DEVNULL, close_fds=True)


def watch(server_pid: int, stub_pid: int, region: str, grace_seconds: float = 3.0, poll_seconds: float = 0.5) -> None:
    """The watcher's loop: returns when the stub exits; once the server is gone, gives the stub's own
    exit `grace_seconds`, then kills it and removes its region."""
    while _running(stub_pid):
        if not _running(server_pid):
            time.sleep(grace_seconds)
            if _running(stub_pid):
                os.kill(stub_pid, signal.SIGKILL)
            remove_shm_regions([region])
            return
        time.sleep(poll_seconds)


if __name__ == "__main__":  # the watcher: python stubs.py SERVER_PID STUB_PID SHM_REGION
    watch(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
