"""`python -m kvpop.serving.process.launcher`: the command line of `make serve`, `make serve-bg` and the container.

Parses the options, installs the Python backend stub (`--prepare-only`, what `make setup` runs), and
runs the supervisor (kvpop.serving.process.supervisor) over a tritonserver process (kvpop.serving.process.tritonserver),
in the foreground or detached with a pid file. The process layer's names most callers need
(`TritonServer`, `free_port`, ...) are re-exported here for them.
"""

from __future__ import annotations

import argparse
import os
import secrets
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from kvpop.serving.process.tritonserver import (
    DEFAULT_MODEL_REPOSITORY,
    ProcessStartError,
    TritonServer,
    choose_model_config,
    count_gpus,
    free_port,
    prepare_python_backend_stub,
)
from kvpop.serving.process.ports import PortInUseError, check_ports
from kvpop.serving.process.state_dir import DEFAULT_STATE_DIR, STATE_DIR_ENV
from kvpop.serving.process.supervisor import ChildProcess, Supervisor, install_signal_handlers

__all__ = ["ProcessStartError", "TritonServer", "choose_model_config", "count_gpus", "free_port", "main"]


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


def writable_state_dir(path: Path) -> None:
    """Create the state directory and make sure the server can write there (OSError naming it if not)."""
    path.mkdir(parents=True, exist_ok=True)
    probe = path / f".write-test-{os.getpid()}"
    try:
        probe.write_text("")
    except OSError as error:
        raise OSError(f"the state directory {path} is not writable ({error.strerror}): choose one with --state-dir") from None
    probe.unlink()


def detach(argv: list[str], pid_file: Path, log_file: Path, health_url: str, timeout: float = 300.0) -> int:
    """Run the supervisor in the background (its pid in pid_file) and wait until it reports ready."""
    log_file.parent.mkdir(parents=True, exist_ok=True)
    with open(log_file.with_name("launcher.log"), "ab") as output:
        child = subprocess.Popen([sys.executable, "-m", "kvpop.serving.process.launcher", *argv], stdout=output,
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


def openai_api(address: str, port: int, grpc_port: int, run_dir: Path) -> ChildProcess:
    """The OpenAI-compatible API beside the server, forwarding to its gRPC port on loopback."""
    host = "127.0.0.1" if address in ("0.0.0.0", "::") else address
    command = [sys.executable, "-m", "kvpop.openai_api", "--host", address, "--port", str(port),
               "--triton-grpc", f"{host}:{grpc_port}"]
    return ChildProcess("openai_api", command, ready_url=f"http://{host}:{port}/health",
                        log_file=run_dir / "openai_api.log")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m kvpop.serving.process.launcher",
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
    parser.add_argument("--state-dir", type=Path, default=Path(os.environ.get(STATE_DIR_ENV) or DEFAULT_STATE_DIR),
                        help="session checkpoints and what else must outlive the server, never inside the model "
                             f"repository ({STATE_DIR_ENV}; default: {DEFAULT_STATE_DIR})")
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
    try:  # before anything is started: one clear error, not a child restarted over and over
        check_ports(args.address, {"HTTP": args.http_port, "gRPC": args.grpc_port, "metrics": args.metrics_port,
                                   "health": args.health_port, "OpenAI API": args.openai_port})
        writable_state_dir(args.state_dir)
    except (PortInUseError, OSError) as error:
        print(f"[serve] {error}", file=sys.stderr)
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
        admin_key=admin_key(args.admin_key, run_dir / "admin-key"), state_dir=args.state_dir,
    )
    gpus = count_gpus()
    config = choose_model_config(gpus) if server.model_config_name == "auto" else server.model_config_name
    print(f"[serve] {gpus} GPU(s) visible: model config {config or 'config.pbtxt'}", flush=True)
    children = [openai_api(args.address, args.openai_port, args.grpc_port, run_dir)] if args.openai_port else []
    supervisor = Supervisor(server, health_port=args.health_port or None, grace_seconds=args.grace_seconds,
                            children=children)
    install_signal_handlers(supervisor)
    return supervisor.run()


if __name__ == "__main__":
    sys.exit(main())
