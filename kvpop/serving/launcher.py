"""Start, wait for and stop a real `tritonserver` on this repository's model repository.

Used by `make serve` and by the end-to-end tests. On a development machine the server binary and
the Python backend come from the `nvidia-pytriton` wheel installed in the virtualenv; in the NGC
image (`nvcr.io/nvidia/tritonserver:<yy.mm>-py3`) they are under /opt/tritonserver.
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import psutil

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_MODEL_REPOSITORY = REPO_ROOT / "model_repository"
NGC_TRITON_HOME = Path("/opt/tritonserver")


# Triton APIs only operators may call: the admin key guards them on HTTP and gRPC. Left open:
# health, metadata, inference and model-config (clients and load balancers need them).
ADMIN_APIS = ("model-repository", "shared-memory", "logging", "trace", "statistics")
ADMIN_KEY_HEADER = "kvpop-admin-key"


STUB_BINARY = "triton_python_backend_stub"
SHM_DIR = Path("/dev/shm")


class LauncherError(RuntimeError):
    pass


@dataclass(frozen=True)
class StubProcess:
    pid: int
    model: str  # e.g. kvpop_engine (from the stub's model.py path)
    shm_region: str  # its shared-memory region name in /dev/shm

    @classmethod
    def from_process(cls, process: psutil.Process) -> "StubProcess | None":
        try:
            command = process.cmdline()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            return None
        if not command or not command[0].endswith(STUB_BINARY) or len(command) < 3:
            return None
        return cls(process.pid, Path(command[1]).parent.parent.name, command[2])

    def is_alive(self) -> bool:
        try:
            return psutil.Process(self.pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False


def stub_processes(server_pid: int) -> list[StubProcess]:
    try:
        children = psutil.Process(server_pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    return [stub for stub in map(StubProcess.from_process, children) if stub is not None]


def remove_shm_regions(regions: list[str]) -> None:
    """Remove Python-backend shared-memory regions (a crashed stub leaves its region behind)."""
    for region in regions:
        for path in SHM_DIR.glob(f"{region}*"):
            path.unlink(missing_ok=True)


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
    raise LauncherError("tritonserver not found: run `make setup` (installs nvidia-pytriton into .venv)")


def prepare_python_backend_stub() -> None:
    """The bundled server only looks for the Python backend stub next to libtriton_python.so."""
    bundle = _site_packages() / "pytriton" / "tritonserver"
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = bundle / "python_backend_stubs" / version / "triton_python_backend_stub"
    target = bundle / "backends" / "python" / "triton_python_backend_stub"
    if not bundle.exists():
        return  # NGC image: the stub is already in place
    if not stub.exists():
        raise LauncherError(f"no Python backend stub for Python {version} in {stub.parent.parent}")
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
    extra_env: dict[str, str] = field(default_factory=dict)
    process: subprocess.Popen | None = None

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
        env.update(self.extra_env)
        return env

    def start(self) -> "TritonServer":
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
            start_new_session=True,
        )
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
                raise LauncherError(f"tritonserver exited with code {self.process.returncode} before it was ready")
            if self.is_ready() and self.metrics_up():
                return
            time.sleep(0.5)
        raise LauncherError(f"tritonserver not ready after {timeout:.0f} s")

    def stop(self, timeout: float = 30.0) -> None:
        """Stop gracefully (SIGINT, Triton's own exit timeout), then make sure nothing is left: no stub
        process and none of its /dev/shm regions."""
        if self.process is None:
            return
        regions = self.shm_regions()
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self.kill_leftovers()
        remove_shm_regions(regions)

    def shm_regions(self) -> list[str]:
        """The shared-memory regions of this server's Python backend stubs."""
        return [stub.shm_region for stub in stub_processes(self.process.pid)]

    def kill_leftovers(self) -> None:
        """SIGKILL what is left of the server's process group: a stub orphaned by a crashed server
        ignores SIGTERM and would hold its shared memory forever."""
        if self.process is None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

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


def admin_key(explicit: str | None, key_file: Path) -> str:
    """The operator's key (flag or KVPOP_ADMIN_KEY), else a random one written to `key_file` (0600):
    Triton's admin APIs are never open by default."""
    key = explicit or os.environ.get("KVPOP_ADMIN_KEY")
    if key:
        return key
    key = secrets.token_urlsafe(24)
    key_file.parent.mkdir(parents=True, exist_ok=True)
    key_file.touch(mode=0o600)
    key_file.write_text(key + "\n")
    print(f"[serve] admin APIs guarded by a random key in {key_file} (set KVPOP_ADMIN_KEY to choose it)", flush=True)
    return key


def detach(argv: list[str], pid_file: Path, log_file: Path, health_url: str, timeout: float = 300.0) -> int:
    """Run the supervisor in the background (its pid in pid_file) and wait until it reports ready."""
    log_file.parent.mkdir(parents=True, exist_ok=True)
    with open(log_file.with_name("launcher.log"), "ab") as output:
        child = subprocess.Popen([sys.executable, "-m", "kvpop.serving.launcher", *argv], stdout=output,
                                 stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    pid_file.parent.mkdir(parents=True, exist_ok=True)
    pid_file.write_text(f"{child.pid}\n")
    deadline = time.time() + timeout
    while time.time() < deadline:
        if child.poll() is not None:
            print(f"[serve] the server did not start (see {log_file.with_name('launcher.log')})", file=sys.stderr)
            return 1
        try:
            with urllib.request.urlopen(health_url, timeout=2) as response:
                if response.status == 200:
                    print(f"[serve] running in the background (supervisor pid {child.pid}); stop it with `make stop`")
                    return 0
        except OSError:
            pass
        time.sleep(0.5)
    print(f"[serve] not ready after {timeout:.0f} s (see {log_file})", file=sys.stderr)
    return 1


def openai_sidecar(address: str, port: int, grpc_port: int, run_dir: Path):
    """The OpenAI-compatible API beside the server, forwarding to its gRPC port on loopback."""
    from kvpop.serving.sidecar import Sidecar

    grpc_host = "127.0.0.1" if address in ("0.0.0.0", "::") else address
    command = [sys.executable, "-m", "kvpop.openai_api", "--host", address, "--port", str(port),
               "--triton-grpc", f"{grpc_host}:{grpc_port}"]
    return Sidecar("openai_api", command, run_dir / "openai_api.log", url=f"http://{grpc_host}:{port}/v1")


def main(argv: list[str] | None = None) -> int:
    from kvpop.serving.supervisor import Supervisor, install_signal_handlers

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m kvpop.serving.launcher",
                                     description="Run and supervise tritonserver on the model repository.")
    parser.add_argument("--model-repository", type=Path, default=DEFAULT_MODEL_REPOSITORY)
    parser.add_argument("--http-port", type=int, default=8000)
    parser.add_argument("--grpc-port", type=int, default=8001)
    parser.add_argument("--metrics-port", type=int, default=8002)
    parser.add_argument("--health-port", type=int, default=8003, help="the supervisor's /ready and /live (0: off)")
    parser.add_argument("--address", default="127.0.0.1", help="bind address (containers pass 0.0.0.0)")
    parser.add_argument("--model-config-name", default="auto", help="auto: two-GPU config.pbtxt, single_gpu or cpu")
    parser.add_argument("--grace-seconds", type=float, default=float(os.environ.get("KVPOP_GRACE_SECONDS", "30")),
                        help="on SIGTERM, how long running requests may take to finish (KVPOP_GRACE_SECONDS)")
    parser.add_argument("--admin-key", default=None,
                        help="key for Triton's admin APIs, sent as header kvpop-admin-key (KVPOP_ADMIN_KEY; "
                             "default: a random key written beside the log)")
    parser.add_argument("--openai-port", type=int, default=9000,
                        help="the OpenAI-compatible API's port (python -m kvpop.openai_api; 0: off)")
    parser.add_argument("--pid-file", type=Path, help="run in the background; the supervisor's pid goes here")
    parser.add_argument("--log-file", type=Path)
    parser.add_argument("--prepare-only", action="store_true", help="only install the Python backend stub")
    args = parser.parse_args(argv)

    prepare_python_backend_stub()
    if args.prepare_only:
        return 0
    if not any(Path(args.model_repository).glob("*/1/model_spec.json")):
        print("no exported model in the model repository: run `make export` first", file=sys.stderr)
        return 1
    run_dir = (args.log_file or Path("run/tritonserver.log")).parent
    if args.pid_file:
        host = "127.0.0.1" if args.address in ("0.0.0.0", "127.0.0.1") else args.address
        foreground = list(argv)
        if "--pid-file" in foreground:  # "--pid-file PATH"
            index = foreground.index("--pid-file")
            del foreground[index:index + 2]
        foreground = [arg for arg in foreground if not arg.startswith("--pid-file=")]
        return detach(foreground, args.pid_file, args.log_file or run_dir / "tritonserver.log",
                      f"http://{host}:{args.health_port}/ready")
    server = TritonServer(
        args.model_repository, args.http_port, args.grpc_port, args.metrics_port, args.address,
        None if args.model_config_name in ("", "default") else args.model_config_name, args.log_file,
        admin_key=admin_key(args.admin_key, run_dir / "admin-key"),
    )
    gpus = count_gpus()
    config = choose_model_config(gpus) if server.model_config_name == "auto" else server.model_config_name
    print(f"[serve] {gpus} GPU(s) visible: model config {config or 'config.pbtxt'}", flush=True)
    sidecars = [openai_sidecar(args.address, args.openai_port, args.grpc_port, run_dir)] if args.openai_port else []
    supervisor = Supervisor(server, health_port=args.health_port or None, grace_seconds=args.grace_seconds,
                            sidecars=sidecars)
    install_signal_handlers(supervisor)
    return supervisor.run()


if __name__ == "__main__":
    from kvpop.serving.launcher import main as package_main  # one LauncherError class, not a __main__ copy

    sys.exit(package_main())
