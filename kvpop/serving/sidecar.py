"""A process that lives beside tritonserver under the supervisor (the OpenAI-compatible API).

The supervisor starts it once the server is ready, starts it again whenever it exits, and stops it
after the server has drained, so its running streams can finish within the grace period.
"""

from __future__ import annotations

import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Sidecar:
    name: str
    command: list[str]
    log_file: Path | None = None
    url: str = ""  # where clients reach it, for the start-up line
    process: subprocess.Popen | None = field(default=None, repr=False)
    restarts: int = 0

    def start(self) -> None:
        output = subprocess.DEVNULL
        if self.log_file is not None:
            self.log_file.parent.mkdir(parents=True, exist_ok=True)
            output = open(self.log_file, "ab")  # noqa: SIM115 (the child keeps it open)
        self.process = subprocess.Popen(self.command, stdout=output, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        if output is not subprocess.DEVNULL:
            output.close()

    def is_alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self, timeout: float = 10.0) -> None:
        if not self.is_alive():
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(5)
