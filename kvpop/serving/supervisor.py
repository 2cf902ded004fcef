"""The supervisor `make serve` and the container run: keeps one tritonserver honest and alive.

Triton 2.51 neither restarts a Python backend stub that died nor reports it: its health endpoints
keep answering 200 while every request to the dead stub hangs. So the supervisor
- watches the server's stub processes and, when one dies (or the server exits), restarts the server
  at once: the dropped connections give in-flight requests an immediate error, and the model is
  back within its load time;
- serves the truthful health endpoints on its own port: `/ready` is 200 only while the server is
  ready AND every stub it started is alive AND it is not draining; `/live` while this loop runs;
- keeps its sidecars (the OpenAI-compatible API) running, restarting one that exits;
- on SIGTERM (or Ctrl-C) drains: readiness goes false, the engine refuses new work as UNAVAILABLE
  (kvpop.serving.drain), running generations finish within the grace period or get a clear error,
  then the server stops, leftover stubs and their /dev/shm regions are removed, and it exits 0.
"""

from __future__ import annotations

import json
import signal
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


from kvpop.serving.drain import DRAIN_FILE_ENV, DrainSignal
from kvpop.serving.launcher import LauncherError, StubProcess, TritonServer, remove_shm_regions, stub_processes
from kvpop.serving.sidecar import Sidecar

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


class Supervisor:
    """Runs `server` until SIGTERM/SIGINT; restarts it when it or one of its stubs dies."""

    def __init__(self, server: TritonServer, health_port: int | None = 8003, grace_seconds: float = 30.0,
                 poll_seconds: float = 0.5, max_restarts: int = 10, drain_file: Path | None = None,
                 sidecars: list[Sidecar] | None = None) -> None:
        self.server, self.health_port = server, health_port
        self.sidecars = list(sidecars or [])
        self.grace_seconds, self.poll_seconds, self.max_restarts = grace_seconds, poll_seconds, max_restarts
        drain_file = drain_file or Path(server.log_file or "run/tritonserver.log").with_name(
            f"drain-{server.http_port}.flag")
        drain_file.parent.mkdir(parents=True, exist_ok=True)
        self.drain = DrainSignal(drain_file)
        self.drain.clear()
        server.extra_env[DRAIN_FILE_ENV] = str(drain_file)
        self.state = "starting"  # starting | ready | restarting | draining | stopped
        self.restarts: list[dict] = []  # what died and how long the recovery took
        self.stubs: list[StubProcess] = []
        self._stop_requested = threading.Event()
        self._heartbeat = time.monotonic()
        self._health: ThreadingHTTPServer | None = None

    # -- health endpoints ------------------------------------------------------------------------
    def status(self) -> dict:
        return {"state": self.state, "ready": self.is_ready(), "stubs": [stub.__dict__ for stub in self.stubs],
                "sidecars": {sidecar.name: {"alive": sidecar.is_alive(), "restarts": sidecar.restarts}
                             for sidecar in self.sidecars},
                "restarts": self.restarts[-5:]}

    def is_ready(self) -> bool:
        return (self.state == "ready" and all(stub.is_alive() for stub in self.stubs)
                and all(sidecar.is_alive() for sidecar in self.sidecars)
                and self.server.process is not None and self.server.process.poll() is None)

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
        except LauncherError as error:
            self._log(f"{error}")
            self._stop_server()
            return 1
        for sidecar in self.sidecars:
            sidecar.start()
        self._log(f"READY  HTTP http://{self.server.http_url}/v2/models/kvpop_service/infer  gRPC {self.server.grpc_url}"
                  f"  metrics {self.server.metrics_url}"
                  + (f"  health http://{self.server.http_url.rsplit(':', 1)[0]}:{self.health_port}/ready"
                     if self.health_port else "")
                  + "".join(f"  {sidecar.name} {sidecar.url}" for sidecar in self.sidecars))
        while not self._stop_requested.wait(self.poll_seconds):
            self._heartbeat = time.monotonic()
            self._restart_exited_sidecars()
            reason = self._failure()
            if reason is None:
                continue
            if len(self.restarts) >= self.max_restarts:
                self._log(f"{reason}; {len(self.restarts)} restarts already: giving up (exit 1)")
                self._stop_server()
                for sidecar in self.sidecars:
                    sidecar.stop()
                return 1
            self._restart(reason)
        self._drain_and_stop()
        return 0

    def _failure(self) -> str | None:
        process = self.server.process
        if process is None or process.poll() is not None:
            return f"tritonserver exited with code {None if process is None else process.returncode}"
        dead = [stub for stub in self.stubs if not stub.is_alive()]
        if dead:
            return "Python backend stub died: " + ", ".join(f"{stub.model} (pid {stub.pid})" for stub in dead)
        return None

    def _restart_exited_sidecars(self) -> None:
        for sidecar in self.sidecars:
            if sidecar.process is not None and not sidecar.is_alive():
                self._log(f"{sidecar.name} exited with code {sidecar.process.returncode}: restarting it")
                sidecar.restarts += 1
                sidecar.start()

    def _start_server(self) -> None:
        self.state = "starting"
        self.server.start()
        self.server.wait_ready()
        # Stubs start while models load: once the server is ready every one of them exists.
        self.stubs = stub_processes(self.server.process.pid)
        self.state = "ready"

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
        except LauncherError as error:
            self._log(f"restart failed: {error}")
            self.restarts.append({"reason": reason, "recovered": False, "server_aborted": server_aborted})
            return
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
        self._stop_server()
        for sidecar in self.sidecars:
            sidecar.stop()
        self.drain.clear()
        self.state = "stopped"
        self._log("stopped")

    def _stop_server(self, force: bool = False) -> None:
        """Stop the server, then kill whatever of its process group is left and clean /dev/shm."""
        regions = [stub.shm_region for stub in self.stubs]  # a dead stub's region too
        self.server.stop(timeout=2 if force else 30)
        remove_shm_regions(regions)
        self.stubs = []

    def _log(self, message: str) -> None:
        print(f"[serve] {message}", flush=True)


def install_signal_handlers(supervisor: Supervisor) -> None:
    # Ctrl-C, `kill`, `docker stop` and Kubernetes all drain; installed explicitly because a shell
    # may start us with SIGINT ignored.
    for signal_number in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signal_number, supervisor.request_stop)
