"""The supervisor `make serve` and the container run: keeps one tritonserver honest and alive, and
the child processes that serve beside it (`ChildProcess`, e.g. an HTTP front end over the server).

Triton 2.51 neither restarts a Python backend stub that died nor reports it: its health endpoints
keep answering 200 while every request to the dead stub hangs. So the supervisor
- watches the server's stub processes and, when one dies (or the server exits), restarts the server
  at once: the dropped connections give in-flight requests an immediate error, and the model is
  back within its load time;
- serves the truthful health endpoints on its own port: `/ready` is 200 only while the server is
  ready AND every stub it started is alive AND it is not draining; `/live` while this loop runs;
- on SIGTERM (or Ctrl-C) drains: readiness goes false, the engine refuses new work as UNAVAILABLE
  (kvpop.serving.process.drain), running generations finish within the grace period or get a clear error,
  then the children and the server stop, leftover stubs and their /dev/shm regions are removed, and
  it exits 0;
- restarts a child that exited on its own, without touching the server.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Sequence

from kvpop.serving.process.tritonserver import ProcessStartError, TritonServer, die_with_parent
from kvpop.serving.process.stubs import StubProcess

RESTART_NOTICE_SECONDS = 0.5  # the front end's watcher polls every 0.1 s
RESTART_NOTICE_MAX_SECONDS = 5.0  # a loaded machine may need longer to answer what the front end holds
# The gauge falls just before the answer is handed to tritonserver, which still has to write it to the
# client's connection: on a loaded 2-core machine 0.1 s was not always enough (a dropped connection
# instead of the 503), so the restart waits this long more.
RESTART_FLUSH_SECONDS = 1.0
FRONTEND_GAUGES = ("kvpop_frontend_in_flight_requests",)
# Gauges that say whether any request is still being served (summed over instances).
BUSY_GAUGES = ("kvpop_active_sequences", "kvpop_queued_sequences", "kvpop_frontend_in_flight_requests")


def busy_requests(metrics_url: str, gauges: tuple[str, ...] = BUSY_GAUGES) -> float | None:
    """Requests still held by the models (the sum of `gauges`), from the metrics port (None when it
    cannot be read)."""
    try:
        with urllib.request.urlopen(metrics_url, timeout=2) as response:
            text = response.read().decode()
    except OSError:
        return None
    total = 0.0
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in gauges:
            total += float(line.rsplit(" ", 1)[1])
    return total


@dataclass
class ChildProcess:
    """A command run beside tritonserver, started once the server is ready and stopped before it
    (its requests reach the server, so the drain waits for them). Its own process group: stopping it
    stops whatever it started."""

    name: str
    command: list[str]
    ready_url: str | None = None  # answers 200 once the child serves; None: ready when started
    env: dict[str, str] = field(default_factory=dict)
    log_file: Path | None = None
    die_with_parent: bool = False  # SIGKILLed when the process that started it dies (a supervisor's child)
    process: subprocess.Popen | None = None

    def start(self, timeout: float = 120.0) -> None:
        output = open(self.log_file, "ab") if self.log_file else None
        try:
            self.process = subprocess.Popen(self.command, env={**os.environ, **self.env}, stdout=output,
                                            stderr=subprocess.STDOUT if output else None, stdin=subprocess.DEVNULL,
                                            start_new_session=True,
                                            preexec_fn=die_with_parent(os.getpid()) if self.die_with_parent else None)
        finally:
            if output:
                output.close()  # the child holds its own copy
        deadline = time.monotonic() + timeout
        while self.ready_url and not _answers(self.ready_url):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise ProcessStartError(f"{self.name} did not start: {self.failure() or 'not ready'}")
            time.sleep(0.25)

    def failure(self) -> str | None:
        if self.process is None or self.process.poll() is None:
            return None
        return f"{self.name} exited with code {self.process.returncode}"

    def stop(self, timeout: float = 10.0) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.process.wait()

    def status(self) -> dict:
        return {"name": self.name, "pid": self.process.pid if self.process else None, "alive": self.failure() is None}


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


class Supervisor:
    """Runs `server` (and `children` beside it) until SIGTERM/SIGINT; restarts the server when it or
    one of its stubs dies, and a child when it exits."""

    def __init__(self, server: TritonServer, health_port: int | None = 8003, grace_seconds: float = 30.0,
                 poll_seconds: float = 0.5, max_restarts: int = 10, drain_file: Path | None = None,
                 children: Sequence[ChildProcess] = ()) -> None:
        self.server, self.health_port, self.children = server, health_port, list(children)
        self.grace_seconds, self.poll_seconds, self.max_restarts = grace_seconds, poll_seconds, max_restarts
        drain_file = drain_file or Path(server.log_file or "run/tritonserver.log").with_name(
            f"drain-{server.http_port}.flag")
        drain_file.parent.mkdir(parents=True, exist_ok=True)
        server.drain_file = drain_file
        self.drain = server.drain
        self.drain.clear()
        # Nothing it starts may outlive it, even when it is killed with SIGKILL (a service manager whose
        # stop timeout ran out): every start happens on the thread that runs `run`, the main one.
        for process in (server, *self.children):
            process.die_with_parent = True
        self.state = "starting"  # starting | ready | restarting | draining | stopped
        self.restarts: list[dict] = []  # what died and how long the recovery took
        self._stop_requested = threading.Event()
        self._heartbeat = time.monotonic()
        self._health: ThreadingHTTPServer | None = None

    @property
    def stubs(self) -> list[StubProcess]:
        return self.server.stubs

    # -- health endpoints ------------------------------------------------------------------------
    def status(self) -> dict:
        return {"state": self.state, "ready": self.is_ready(), "stubs": [stub.__dict__ for stub in self.stubs],
                "children": [child.status() for child in self.children], "restarts": self.restarts[-5:]}

    def is_ready(self) -> bool:
        return (self.state == "ready" and all(stub.is_alive() for stub in self.stubs)
                and self.server.process is not None and self.server.process.poll() is None
                and all(child.failure() is None for child in self.children))

    def is_live(self) -> bool:
        return time.monotonic() - self._heartbeat < max(10.0, 20 * self.poll_seconds)

    def _serve_health(self) -> None:
        supervisor = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server's name)
                if self.path.startswith("/ready"):
                    ok = supervisor.is_ready()
                elif self.path.startswith("/live"):
                    ok = supervisor.is_live()
                else:
                    self.send_error(404)
                    return
                body = json.dumps(supervisor.status()).encode()
                self.send_response(200 if ok else 503)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):  # probes every few seconds: keep the log for events
                pass

        self._health = ThreadingHTTPServer((self.server.address, self.health_port), Handler)
        threading.Thread(target=self._health.serve_forever, name="kvpop-health", daemon=True).start()

    # -- lifecycle ---------------------------------------------------------------------------------
    def request_stop(self, *_: object) -> None:
        self._stop_requested.set()

    def run(self) -> int:
        if self.health_port:
            self._serve_health()
        try:
            self._start_server()
            for child in self.children:
                child.start()
            self.state = "ready"  # only once the children serve too
        except ProcessStartError as error:
            self._log(f"{error}")
            self._stop_children()
            self._stop_server()
            return 1
        self._log(f"READY  HTTP http://{self.server.http_url}/v2/models/kvpop_service/infer  gRPC {self.server.grpc_url}"
                  f"  metrics {self.server.metrics_url}"
                  + (f"  health http://{self.server.http_url.rsplit(':', 1)[0]}:{self.health_port}/ready"
                     if self.health_port else ""))
        while not self._stop_requested.wait(self.poll_seconds):
            self._heartbeat = time.monotonic()
            reason = self._failure()
            dead_child = None if reason else next((child for child in self.children if child.failure()), None)
            if reason is None and dead_child is None:
                continue
            if len(self.restarts) >= self.max_restarts:
                self._log(f"{reason or dead_child.failure()}; {len(self.restarts)} restarts already: giving up (exit 1)")
                self._stop_children()
                self._stop_server()
                return 1
            if reason is not None:
                self._restart(reason)
            else:
                self._restart_child(dead_child, dead_child.failure())
        self._drain_and_stop()
        return 0

    def _failure(self) -> str | None:
        """Why the server must restart, if it must."""
        process = self.server.process
        if process is None or process.poll() is not None:
            return f"tritonserver exited with code {None if process is None else process.returncode}"
        dead = [stub for stub in self.stubs if not stub.is_alive()]
        if dead:
            return "Python backend stub died: " + ", ".join(f"{stub.model} (pid {stub.pid})" for stub in dead)
        return None

    def _restart_child(self, child: ChildProcess, reason: str) -> None:
        self.state = "restarting"
        self._log(f"{reason}: restarting it")
        child.stop()
        try:
            child.start()
        except ProcessStartError as error:
            self._log(f"restart failed: {error}")
            self.restarts.append({"reason": reason, "recovered": False})
            return
        self.state = "ready"
        self.restarts.append({"reason": reason, "recovered": True})

    def _start_server(self) -> None:
        self.state = "starting"
        self.server.start()
        self.server.wait_ready()

    def _restart(self, reason: str) -> None:
        started = time.monotonic()
        self.state = "restarting"
        self._log(f"{reason}: restarting tritonserver")
        # Requests still held by a live front end (or engine) get UNAVAILABLE now, not a dropped
        # connection: a drain with no grace, then the restart.
        self.drain.start(0)
        self._wait_for_front_end_answers()
        # tritonserver 2.51 sometimes aborts over a dead stub on its own: its connections dropped then.
        server_aborted = self.server.process.poll() is not None
        self._stop_server(force=True)
        self.drain.clear()
        try:
            self._start_server()
        except ProcessStartError as error:
            self._log(f"restart failed: {error}")
            self.restarts.append({"reason": reason, "recovered": False, "server_aborted": server_aborted})
            return
        self.state = "ready"
        seconds = round(time.monotonic() - started, 1)
        self.restarts.append({"reason": reason, "recovered": True, "seconds": seconds, "server_aborted": server_aborted})
        self._log(f"recovered in {seconds} s")

    def _wait_for_front_end_answers(self) -> None:
        """After the restart notice: until the front end holds no request (it answered each with
        UNAVAILABLE) and its answers had time to leave, at least RESTART_NOTICE_SECONDS and at most
        RESTART_NOTICE_MAX_SECONDS (a dead front end's gauge never falls; a server that exited ends the wait)."""
        started = time.monotonic()
        time.sleep(RESTART_NOTICE_SECONDS)
        while time.monotonic() - started < RESTART_NOTICE_MAX_SECONDS:
            busy = busy_requests(self.server.metrics_url, FRONTEND_GAUGES)
            if busy == 0:
                time.sleep(RESTART_FLUSH_SECONDS)
                return
            if busy is None and self.server.process.poll() is not None:
                return  # the server is gone: nothing is left to answer
            time.sleep(0.1)  # busy, or a metrics port too loaded to answer in time: ask again

    def _drain_and_stop(self) -> None:
        self.state = "draining"
        self._log(f"draining: new requests are refused, running ones have {self.grace_seconds:.0f} s")
        self.drain.start(self.grace_seconds)
        deadline = time.monotonic() + self.grace_seconds + 5  # the engine fails leftovers at the deadline
        while time.monotonic() < deadline and self.server.process.poll() is None:
            busy = busy_requests(self.server.metrics_url)
            if busy == 0:
                break
            time.sleep(0.25)
        self._stop_children()
        self._stop_server()
        self.drain.clear()
        self.state = "stopped"
        self._log("stopped")

    def _stop_server(self, force: bool = False) -> None:
        """Stop the server; it kills whatever of its process group is left and cleans /dev/shm."""
        self.server.stop(timeout=2 if force else 30)

    def _stop_children(self) -> None:
        for child in reversed(self.children):
            child.stop()

    def _log(self, message: str) -> None:
        print(f"[serve] {message}", flush=True)


def install_signal_handlers(supervisor: Supervisor) -> None:
    # Ctrl-C, `kill`, `docker stop` and Kubernetes all drain; installed explicitly because a shell
    # may start us with SIGINT ignored.
    for signal_number in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signal_number, supervisor.request_stop)
