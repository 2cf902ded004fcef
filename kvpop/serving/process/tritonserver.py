"""The tritonserver process: where the binary is, its command line and environment, start and stop,
its Python backend stubs, and the shared memory they leave behind.

On a development machine the server binary and the Python backend come from the `nvidia-pytriton`
wheel installed in the virtualenv; in the NGC image (`nvcr.io/nvidia/tritonserver:<yy.mm>-py3`) they
are under /opt/tritonserver. The supervisor (kvpop.serving.process.supervisor) keeps such a process alive;
tests and benchmarks start one directly (`with TritonServer(...) as server:`).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from kvpop.serving.process.drain import DRAIN_FILE_ENV, DrainSignal
from kvpop.serving.process.state_dir import STATE_DIR_ENV
from kvpop.serving.process.stubs import StubProcess, kill_stubs, orphaned_stubs, remove_shm_regions, stub_processes

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_MODEL_REPOSITORY = REPO_ROOT / "model_repository"
NGC_TRITON_HOME = Path("/opt/tritonserver")


# Triton APIs only operators may call: the admin key guards them on HTTP and gRPC. Left open:
# health, metadata, inference and model-config (clients and load balancers need them).
ADMIN_APIS = ("model-repository", "shared-memory", "logging", "trace", "statistics")
ADMIN_KEY_HEADER = "kvpop-admin-key"


class ProcessStartError(RuntimeError):
    """A process (tritonserver, or a child beside it) cannot be found, started or made ready."""


_PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(None, use_errno=True)  # resolved here: the forked child only calls it


def die_with_parent(parent_pid: int) -> Callable[[], None]:
    """A `preexec_fn` that makes the child SIGKILLed when its parent dies (Linux PR_SET_PDEATHSIG),
    so that a supervisor killed with SIGKILL leaves no child behind. The kernel ties the signal to the
    thread that forked the child: start it from a thread that lives as long as the parent (the main one)."""

    def set_death_signal() -> None:
        _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent_pid:  # the parent died before the signal was armed
            os._exit(1)

    return set_death_signal


@dataclass(frozen=True)
class TritonInstallation:
    binary: Path
    backend_dir: Path
    library_dirs: tuple[Path, ...] = ()


def _site_packages() -> Path:
    return Path(sysconfig.get_paths()["purelib"])


def find_tritonserver() -> TritonInstallation:
    """The pip-bundled server of this virtualenv, else the NGC image's, else one on PATH."""
    bundle = _site_packages() / "pytriton" / "tritonserver"
    if (bundle / "bin" / "tritonserver").exists():
        libs = [Path(sysconfig.get_config_var("LIBDIR")), _site_packages() / "nvidia_pytriton.libs"]
        return TritonInstallation(bundle / "bin" / "tritonserver", bundle / "backends", tuple(libs))
    if (NGC_TRITON_HOME / "bin" / "tritonserver").exists():
        return TritonInstallation(NGC_TRITON_HOME / "bin" / "tritonserver", NGC_TRITON_HOME / "backends")
    on_path = shutil.which("tritonserver")
    if on_path:
        return TritonInstallation(Path(on_path), Path(on_path).resolve().parents[1] / "backends")
    raise ProcessStartError("tritonserver not found: run `make setup` (installs nvidia-pytriton into .venv)")


def prepare_python_backend_stub() -> None:
    """The bundled server only looks for the Python backend stub next to libtriton_python.so."""
    bundle = _site_packages() / "pytriton" / "tritonserver"
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = bundle / "python_backend_stubs" / version / "triton_python_backend_stub"
    target = bundle / "backends" / "python" / "triton_python_backend_stub"
    if not bundle.exists():
        return  # NGC image: the stub is already in place
    if not stub.exists():
        raise ProcessStartError(f"no Python backend stub for Python {version} in {stub.parent.parent}")
    if not target.exists() or target.stat().st_size != stub.stat().st_size:
        shutil.copy2(stub, target)


def count_gpus() -> int:
    """Number of NVIDIA GPUs visible (0 when nvidia-smi is missing or fails)."""
    if os.environ.get("CUDA_VISIBLE_DEVICES") == "":
        return 0
    try:
        listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in listing.stdout.splitlines() if line.startswith("GPU "))


def choose_model_config(gpus: int) -> str | None:
    """config.pbtxt is the two-GPU production config; configs/<name>.pbtxt are the variants."""
    if gpus >= 2:
        return None
    return "single_gpu" if gpus == 1 else "cpu"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class TritonServer:
    """A tritonserver child process. Use as a context manager, or start()/stop()."""

    model_repository: Path = DEFAULT_MODEL_REPOSITORY
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    address: str = "0.0.0.0"
    model_config_name: str | None = "auto"
    log_file: Path | None = None
    extra_args: list[str] = field(default_factory=list)
    admin_key: str | None = None  # guards Triton's admin APIs (header kvpop-admin-key); None: unguarded
    state_dir: Path | None = None  # session checkpoints (kvpop.serving.process.state_dir); None: run/state under the cwd
    die_with_parent: bool = False  # SIGKILLed when the process that started it dies (a supervisor's child)
    drain_file: Path | None = None  # the models' drain signal (kvpop.serving.process.drain); None: one beside the log
    process: subprocess.Popen | None = None
    stubs: list[StubProcess] = field(default_factory=list)  # its Python backend stubs, once it was ready

    @property
    def http_url(self) -> str:
        return f"{self._host}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self._host}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self._host}:{self.metrics_port}/metrics"

    @property
    def _host(self) -> str:
        return "127.0.0.1" if self.address in ("0.0.0.0", "127.0.0.1") else self.address

    def command(self, installation: TritonInstallation) -> list[str]:
        config_name = choose_model_config(count_gpus()) if self.model_config_name == "auto" else self.model_config_name
        command = [
            str(installation.binary),
            f"--model-repository={Path(self.model_repository).resolve()}",
            f"--backend-directory={installation.backend_dir}",
            f"--http-address={self.address}",
            f"--http-port={self.http_port}",
            f"--grpc-address={self.address}",
            f"--grpc-port={self.grpc_port}",
            f"--metrics-address={self.address}",
            f"--metrics-port={self.metrics_port}",
            "--exit-timeout-secs=10",
            "--log-verbose=0",
        ]
        if config_name:
            command.append(f"--model-config-name={config_name}")
        if self.admin_key:
            restricted = f"{','.join(ADMIN_APIS)}:{ADMIN_KEY_HEADER}={self.admin_key}"
            command += [f"--http-restricted-api={restricted}", f"--grpc-restricted-protocol={restricted}"]
        return command + list(self.extra_args)

    def environment(self, installation: TritonInstallation) -> dict[str, str]:
        env = dict(os.environ)
        # The stub's embedded interpreter finds `python3` on PATH and uses that venv's site-packages.
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
        library_path = [str(path) for path in installation.library_dirs] + [env.get("LD_LIBRARY_PATH", "")]
        env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, library_path))
        # kvpop_service reaches the engine through this server's own gRPC endpoint.
        env["KVPOP_ENGINE_GRPC_URL"] = self.grpc_url
        if self.state_dir is not None:
            env[STATE_DIR_ENV] = str(Path(self.state_dir).resolve())
        env[DRAIN_FILE_ENV] = str(self.drain.path)
        return env

    def start(self) -> "TritonServer":
        """Start the server; first kill what an earlier server of this object, or of this model
        repository, left behind (stubs whose server is gone, and their /dev/shm regions)."""
        if self.process is not None and self.process.poll() is None:
            raise ProcessStartError(f"tritonserver (pid {self.process.pid}) is already running")
        self.stop()
        kill_stubs(orphaned_stubs(self.model_repository))
        self.drain.clear()
        installation = find_tritonserver()
        prepare_python_backend_stub()
        if self.log_file:
            Path(self.log_file).parent.mkdir(parents=True, exist_ok=True)
        output = open(self.log_file, "ab") if self.log_file else None
        self.process = subprocess.Popen(
            self.command(installation),
            env=self.environment(installation),
            stdout=output,
            stderr=subprocess.STDOUT if output else None,
            start_new_session=True,  # its own process group: its stubs are found (and killed) by it
            preexec_fn=die_with_parent(os.getpid()) if self.die_with_parent else None,
        )
        if output:
            output.close()  # the server holds its own copy
        return self

    def is_ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.http_url}/v2/health/ready", timeout=2) as response:
                return response.status == 200
        except OSError:
            return False

    def metrics_up(self) -> bool:
        """Whether the metrics endpoint answers: Triton starts it tens of ms after HTTP reports ready."""
        try:
            with urllib.request.urlopen(self.metrics_url, timeout=2) as response:
                return response.status == 200
        except OSError:
            return False

    def wait_ready(self, timeout: float = 180.0) -> None:
        """Until the models are ready and the metrics endpoint answers (what a caller reads first)."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise ProcessStartError(f"tritonserver exited with code {self.process.returncode} before it was ready")
            if self.is_ready() and self.metrics_up():
                self.stubs = stub_processes(self.process.pid)  # every model is loaded: all its stubs exist
                return
            time.sleep(0.5)
        raise ProcessStartError(f"tritonserver not ready after {timeout:.0f} s")

    @property
    def drain(self) -> DrainSignal:
        if self.drain_file is None:
            scratch = Path(self.log_file).parent if self.log_file else Path(tempfile.gettempdir())
            self.drain_file = scratch / f"kvpop-drain-{os.getpid()}-{self.http_port}.flag"
        return DrainSignal(self.drain_file)

    def stop(self, timeout: float = 30.0) -> None:
        """Stop in order, then make sure nothing is left: no stub process (also after the server died on
        its own) and none of their /dev/shm regions. In order: the models end whatever they still
        answer (the drain signal with no grace: UNAVAILABLE, retryable), then SIGINT. Without that a
        decoupled model streaming an answer never unloads, Triton's exit timeout expires and it dies of
        SIGSEGV with its stubs still running."""
        if self.process is None:
            return
        if self.process.poll() is None:
            self.drain.start(0)
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.drain.clear()
        self.kill_leftovers()

    def kill_leftovers(self) -> None:
        """SIGKILL the stubs left of the server's process group (one that lost its server mid-request
        never exits) and remove every region its stubs had."""
        if self.process is None:
            return
        leftovers = stub_processes(self.process.pid)
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        kill_stubs(leftovers)  # waits for them and removes their regions
        remove_shm_regions([stub.shm_region for stub in self.stubs])
        self.stubs = []

    def __enter__(self) -> "TritonServer":
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()


