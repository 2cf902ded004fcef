"""A child process the supervisor runs beside tritonserver: started until it answers, seen when it
exits, stopped with its whole process group. A real child (Python's http.server), no Triton."""

from __future__ import annotations

import os
import signal
import sys

from kvpop.serving.process.tritonserver import free_port
from kvpop.serving.process.supervisor import ChildProcess


def test_child_process_starts_reports_its_exit_and_stops(tmp_path):
    port = free_port()
    child = ChildProcess("static", [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
                         ready_url=f"http://127.0.0.1:{port}/", log_file=tmp_path / "child.log")
    child.start(timeout=60)
    try:
        assert child.failure() is None and child.status()["alive"]
        os.kill(child.process.pid, signal.SIGKILL)
        child.process.wait(10)
        assert child.failure() == f"static exited with code {-signal.SIGKILL}"
        child.start(timeout=60)  # what the supervisor does with a child that exited
        assert child.failure() is None
    finally:
        child.stop()
    assert child.process.poll() is not None
