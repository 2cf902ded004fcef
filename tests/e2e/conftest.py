"""A real tritonserver on free loopback ports, serving the repository's kvpop_service with a tiny model.

The model repository is assembled in a temporary folder from the committed configs and model.py files
plus a freshly exported tiny Llama (export.repository), so the tests never touch (or depend on) `make
export`'s output.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from export.repository import assemble_model_repository
from kvpop.serving.process.tritonserver import TritonServer, free_port


def checkpoint_dir(server: TritonServer) -> Path:
    """Where `server`'s engine writes its session checkpoints (its state directory, never the model repository)."""
    return Path(server.state_dir) / "kvpop_engine" / "sessions"


def wait_for_checkpoint(sessions_dir: Path, session_id: str, tokens: int, timeout: float = 30.0) -> Path:
    """The session's checkpoint file once it holds `tokens` tokens. Checkpoints are written by the
    store's writer thread a few milliseconds after the turn's response, so a test that reads, damages
    or relies on the file (a SIGKILL) waits for it; the file name is the id's keyed hash."""
    import json
    import struct
    import time

    from kvpop.sessions import SessionKey

    path = sessions_dir / f"{SessionKey.of(session_id, (sessions_dir / 'session.key').read_bytes()).digest}.safetensors"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            data = path.read_bytes()
            header = json.loads(data[8 : 8 + struct.unpack("<Q", data[:8])[0]])
            if header["tokens"]["shape"] == [tokens]:
                return path
        except (OSError, ValueError, KeyError, struct.error):
            pass
        time.sleep(0.01)
    raise AssertionError(f"no checkpoint of {session_id!r} with {tokens} tokens after {timeout} s")


# Small limits so that admission, degradation and overload can be reached with a tiny model:
# 1 MiB of KV pool is 2048 slots of the tiny model (512 bytes per slot, all layers and heads).
TEST_ENGINE_PARAMETERS = {
    "kv_pool_mb": "1",
    "max_queue_size": "2",
    "default_kv_budget": "128",
    "min_kv_budget": "64",
    "max_prompt_tokens": "512",
    "max_output_tokens": "65536",
    "session_hot_mb": "0",  # a 1 MiB pool has no room for a hot tier: sessions live in warm and cold
}


@pytest.fixture(scope="session")
def triton_server(tmp_path_factory, tiny_onnx_model_dir):
    root = tmp_path_factory.mktemp("model_repository")
    assemble_model_repository(root, tiny_onnx_model_dir, TEST_ENGINE_PARAMETERS)
    log_file = tmp_path_factory.mktemp("logs") / "tritonserver.log"
    server = TritonServer(
        model_repository=root,
        http_port=free_port(),
        grpc_port=free_port(),
        metrics_port=free_port(),
        address="127.0.0.1",
        model_config_name="cpu",
        log_file=log_file,
        admin_key="e2e-admin-key",
        state_dir=tmp_path_factory.mktemp("state"),
    )
    try:
        with server:
            yield server
    finally:
        if server.process is not None and server.process.returncode not in (0, None):
            print(log_file.read_text()[-5000:])


@pytest.fixture(scope="session")
def kvpop_http(triton_server):
    from kvpop_client import KVpopClient

    with KVpopClient(triton_server.http_url, "http") as client:
        yield client


@pytest.fixture(scope="session")
def kvpop_grpc(triton_server):
    from kvpop_client import KVpopClient

    with KVpopClient(triton_server.grpc_url, "grpc") as client:
        yield client


def metric_reader(metrics_url: str):
    """Read a server's Prometheus samples: all of them, or one metric summed over the label sets that
    include the given labels, e.g. read("kvpop_requests_total", finish_reason="cancelled")."""
    from kvpop_client import KVpopClient

    def read(name: str | None = None, **labels: str):
        samples = KVpopClient.metrics(metrics_url)
        if name is None:
            return samples
        total = 0.0
        for key, value in samples.items():
            metric, _, label_text = key.partition("{")
            sample_labels = dict(re.findall(r'(\w+)="([^"]*)"', label_text))
            if metric == name and all(sample_labels.get(k) == v for k, v in labels.items()):
                total += value
        return total

    return read


@pytest.fixture
def metrics(triton_server):
    """The shared server's metrics (metric_reader)."""
    return metric_reader(triton_server.metrics_url)


def start_api(triton_server, env: dict[str, str] | None = None, *args: str, log: Path | None = None):
    """`python -m kvpop.openai_api` against `triton_server` on a free port: (process, base URL) once healthy."""
    port = free_port()
    output = open(log, "wb") if log is not None else subprocess.DEVNULL
    process = subprocess.Popen(
        [sys.executable, "-m", "kvpop.openai_api", "--port", str(port), "--triton-grpc", triton_server.grpc_url, *args],
        env={**os.environ, **(env or {})}, stdout=output, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as response:
                if response.status == 200:
                    return process, url
        except OSError:
            time.sleep(0.2)
    process.kill()
    raise AssertionError("the OpenAI API did not become healthy")


@pytest.fixture(scope="session")
def openai_api_log(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("openai-api") / "openai_api.log"


@pytest.fixture(scope="session")
def openai_api(triton_server, openai_api_log):
    """The OpenAI-compatible API (no key) against the shared server, its output in `openai_api_log`."""
    process, url = start_api(triton_server, {"KVPOP_OPENAI_API_KEY": ""}, log=openai_api_log)
    yield url
    process.terminate()
    process.wait(40)  # uvicorn gives open connections up to 30 s
