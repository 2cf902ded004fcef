"""Faults an operator meets, against the real supervisor (`python -m kvpop.serving.process.launcher`, what
`make serve` and the container run): a Python backend stub killed with SIGKILL, SIGTERM under load, the
launcher stopped hard (SIGTERM, then SIGKILL), and a tritonserver killed with SIGKILL mid-request, whose
stubs must not outlive it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest

from export.repository import assemble_model_repository
from kvpop.serving.process.ports import check_ports
from kvpop.serving.process.tritonserver import TritonServer, free_port
from kvpop_client import KVpopClient, KVpopServerError

from .conftest import TEST_ENGINE_PARAMETERS

pytestmark = [pytest.mark.server, pytest.mark.faults]
PROMPT = "Let a = 7. What is a?"


class Supervised:
    """The launcher as a child process on free loopback ports."""

    def __init__(self, root: Path, grace_seconds: float = 30) -> None:
        self.ports = {name: free_port() for name in ("http", "grpc", "metrics", "health", "openai")}
        self.log = root / "launcher.log"
        command = [sys.executable, "-m", "kvpop.serving.process.launcher", f"--model-repository={root / 'models'}",
                   "--model-config-name=cpu", "--address=127.0.0.1", f"--grace-seconds={grace_seconds}",
                   f"--log-file={root / 'tritonserver.log'}", f"--state-dir={root / 'state'}",
                   *(f"--{name}-port={port}" for name, port in self.ports.items())]
        self.process = subprocess.Popen(command, stdout=open(self.log, "wb"), stderr=subprocess.STDOUT,
                                        env={**os.environ, "KVPOP_ADMIN_KEY": "faults"}, start_new_session=True)
        assert self.wait_ready(180), self.log.read_text()[-3000:]

    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.ports['http']}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.ports['grpc']}"

    def health(self, path: str = "ready") -> tuple[int | None, dict]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.ports['health']}/{path}", timeout=2) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as error:
            return error.code, json.loads(error.read())
        except OSError:
            return None, {}

    def wait_ready(self, timeout: float) -> bool:
        deadline = time.time() + timeout
        while time.time() < deadline and self.process.poll() is None:
            if self.health()[0] == 200:
                return True
            time.sleep(0.2)
        return False

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)


@pytest.fixture
def supervised(tmp_path, tiny_onnx_model_dir):
    assemble_model_repository(tmp_path / "models", tiny_onnx_model_dir,
                           {**TEST_ENGINE_PARAMETERS, "max_queue_size": "64", "kv_pool_mb": "64"})
    server = Supervised(tmp_path, grace_seconds=30)
    yield server
    server.stop()


def generate(url: str, protocol: str, index: int, max_tokens: int) -> str:
    """'ok' or the error a client saw; streams and complete answers alternate."""
    try:
        with KVpopClient(url, protocol, timeout=120) as client:
            if index % 3 == 0:
                chunks = list(client.stream(PROMPT, max_tokens=max_tokens, ignore_eos=True))
                assert chunks[-1].result.num_output_tokens == max_tokens
            else:
                assert client.generate(PROMPT, max_tokens=max_tokens, ignore_eos=True).num_output_tokens == max_tokens
        return "ok"
    except KVpopServerError as error:
        return f"error {error.status}"
    except Exception as error:  # a dropped connection is an error too, never a hang
        return f"error {type(error).__name__}"


def in_flight(server: Supervised | TritonServer, pool: ThreadPoolExecutor, count: int, max_tokens: int):
    urls = {"http": server.http_url, "grpc": server.grpc_url}
    return [pool.submit(generate, urls[protocol], protocol, index, max_tokens)
            for index, protocol in ((index, ("http", "grpc")[index % 2]) for index in range(count))]


@pytest.mark.parametrize("victim", ["kvpop_engine", "kvpop_service"])
def test_a_killed_stub_is_noticed_in_flight_requests_fail_at_once_and_the_service_comes_back(supervised, victim):
    _, status = supervised.health("live")
    stub = next(stub for stub in status["stubs"] if stub["model"] == victim)
    with ThreadPoolExecutor(12) as pool:
        futures = in_flight(supervised, pool, 12, max_tokens=60_000)  # would run for a minute
        time.sleep(2)
        killed_at = time.time()
        os.kill(stub["pid"], signal.SIGKILL)
        outcomes = [future.result(timeout=30) for future in futures]  # none hangs
    assert all(outcome.startswith("error") for outcome in outcomes), outcomes
    assert time.time() - killed_at < 30
    assert supervised.wait_ready(60), supervised.log.read_text()[-3000:]
    _, status = supervised.health()
    restart = status["restarts"][-1]
    # Seen first either way: the dead stub, or tritonserver aborting over it (2.51 sometimes does).
    assert restart["recovered"] and (victim in restart["reason"] or "tritonserver exited" in restart["reason"]), restart
    if victim == "kvpop_engine" and victim in restart["reason"] and not restart["server_aborted"]:
        # The front end outlived the engine: its clients got a retryable 503 / UNAVAILABLE, not a
        # dropped connection (when tritonserver itself aborts, connections drop: still an error).
        complete = [outcome for index, outcome in enumerate(outcomes) if index % 3]
        assert set(complete) <= {"error 503", "error StatusCode.UNAVAILABLE"}, outcomes
    assert stub["pid"] not in [new["pid"] for new in status["stubs"]]
    with KVpopClient(supervised.http_url, "http") as client:
        assert client.generate(PROMPT, max_tokens=4).num_output_tokens == 4


def test_sigterm_drains_in_flight_work_refuses_new_work_and_exits_cleanly(supervised):
    _, status = supervised.health("live")
    regions = [stub["shm_region"] for stub in status["stubs"]]
    with ThreadPoolExecutor(16) as pool:
        futures = in_flight(supervised, pool, 12, max_tokens=1500)  # a few seconds each
        time.sleep(1.0)
        supervised.process.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        assert supervised.health()[0] == 503  # readiness goes false at once
        late = [pool.submit(generate, url, protocol, 1, 4)
                for url, protocol in ((supervised.http_url, "http"), (supervised.grpc_url, "grpc"))]
        outcomes = [future.result(timeout=60) for future in futures]
        late_outcomes = [future.result(timeout=60) for future in late]
    assert outcomes == ["ok"] * 12  # nothing in flight is lost
    assert late_outcomes == ["error 503", "error StatusCode.UNAVAILABLE"]  # retryable refusals
    assert supervised.process.wait(60) == 0
    leftovers = subprocess.run(["pgrep", "-f", "triton_python_backend_stub"], capture_output=True, text=True).stdout
    assert not [region for region in regions if any(Path("/dev/shm").glob(f"{region}*"))]
    for pid in leftovers.split():
        assert not any(region in Path(f"/proc/{pid}/cmdline").read_text(errors="ignore") for region in regions)


def alive(pids: list[int]) -> list[int]:
    def running(pid: int) -> bool:
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    return [pid for pid in pids if running(pid)]


def shm_left(regions: list[str]) -> list[str]:
    return [region for region in regions if any(Path("/dev/shm").glob(f"{region}*"))]


def wait_until_gone(pids: list[int], regions: list[str], timeout: float = 30) -> tuple[list[int], list[str]]:
    deadline = time.time() + timeout
    while (alive(pids) or shm_left(regions)) and time.time() < deadline:
        time.sleep(0.2)
    return alive(pids), shm_left(regions)


def test_a_launcher_stopped_hard_leaves_no_process_and_no_port_behind(supervised):
    """What a service manager does when a drain overruns its stop timeout: SIGTERM, SIGKILL seconds later.
    Every process the launcher started dies with it (tritonserver, the OpenAI API, the stubs)."""
    descendants = psutil.Process(supervised.process.pid).children(recursive=True)
    names = {process.pid: process.name() for process in descendants}
    assert {"tritonserver", "triton_python_backend_stub"} <= set(names.values()) and len(names) >= 4, names
    _, status = supervised.health("live")
    regions = [stub["shm_region"] for stub in status["stubs"]]
    with ThreadPoolExecutor(8) as pool:
        futures = in_flight(supervised, pool, 8, max_tokens=60_000)  # the drain would wait for them
        time.sleep(2)
        supervised.process.send_signal(signal.SIGTERM)
        time.sleep(2)
        supervised.process.kill()
        supervised.process.wait()
        outcomes = [future.result(timeout=60) for future in futures]
    assert all(outcome.startswith("error") for outcome in outcomes), outcomes
    left, shm = wait_until_gone(list(names), regions)
    assert not left, {pid: names[pid] for pid in left}
    assert not shm
    check_ports("127.0.0.1", supervised.ports)  # every port free again: raises naming any still held


def test_the_stubs_of_a_server_killed_mid_request_do_not_outlive_it(tmp_path, tiny_onnx_model_dir):
    """A stub answering a request when its tritonserver is killed would wait on it forever: a restart
    of the server kills the old stubs first, and without one they exit on their own within seconds."""
    root = assemble_model_repository(tmp_path / "models", tiny_onnx_model_dir,
                                     {**TEST_ENGINE_PARAMETERS, "max_queue_size": "64", "kv_pool_mb": "64"})
    server = TritonServer(root, free_port(), free_port(), free_port(), "127.0.0.1", "cpu", tmp_path / "triton.log",
                          state_dir=tmp_path / "state")
    try:
        server.start()
        for restarted in (True, False):
            server.wait_ready()
            stubs = [stub.pid for stub in server.stubs]
            regions = [stub.shm_region for stub in server.stubs]
            assert {stub.model for stub in server.stubs} == {"kvpop_engine", "kvpop_service"}
            with ThreadPoolExecutor(8) as pool:
                futures = in_flight(server, pool, 8, max_tokens=60_000)
                time.sleep(2)
                server.process.kill()  # SIGKILL, as the cluster rehearsal's failover does
                server.process.wait()
                outcomes = [future.result(timeout=60) for future in futures]
            assert all(outcome.startswith("error") for outcome in outcomes), outcomes
            if restarted:
                server.start()  # what the supervisor and the rehearsal do next
                assert not alive(stubs) and not shm_left(regions)  # gone before the new server starts loading
            else:
                assert wait_until_gone(stubs, regions) == ([], [])  # nobody cleans up: the stubs exit by themselves
    finally:
        server.stop()


def test_a_server_stopped_while_it_streams_answers_stops_in_order(tmp_path, tiny_onnx_model_dir):
    """What the supervisor does when it gives up or restarts: stop a server whose engine is streaming.
    The models end those requests with a retryable error and unload, and tritonserver exits 0; it used
    to wait for the streams until its exit timeout expired, then die of SIGSEGV with its stubs running."""
    root = assemble_model_repository(tmp_path / "models", tiny_onnx_model_dir,
                                     {**TEST_ENGINE_PARAMETERS, "max_queue_size": "64", "kv_pool_mb": "64"})
    server = TritonServer(root, free_port(), free_port(), free_port(), "127.0.0.1", "cpu", tmp_path / "triton.log",
                          state_dir=tmp_path / "state")
    with ThreadPoolExecutor(6) as pool:
        with server:
            stubs = [stub.pid for stub in server.stubs]
            futures = in_flight(server, pool, 6, max_tokens=60_000)
            time.sleep(2)
        outcomes = [future.result(timeout=60) for future in futures]
    assert all(outcome.startswith("error") for outcome in outcomes), outcomes
    log = (tmp_path / "triton.log").read_text()
    assert server.process.returncode == 0 and "Exit timeout expired" not in log, log[-3000:]
    assert not alive(stubs)
