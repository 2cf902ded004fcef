"""A real tritonserver on free loopback ports, serving the repository's kvpop_service with a tiny model.

The model repository is assembled in a temporary folder from the committed config and model.py plus
a freshly exported tiny Llama, so the tests never touch (or depend on) `make export`'s output.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from kvpop.serving.launcher import TritonServer, free_port

REPO_ROOT = Path(__file__).resolve().parents[2]
MODEL_REPOSITORY = REPO_ROOT / "model_repository"


def build_model_repository(root: Path, exported_model: Path, engine_parameters: dict[str, str] | None = None) -> Path:
    """The committed models (configs and model.py files) with the exported model in kvpop_engine/1."""
    shutil.copytree(MODEL_REPOSITORY, root, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__"))
    version = root / "kvpop_engine" / "1"
    shutil.copytree(exported_model, version, dirs_exist_ok=True)
    for config in [root / "kvpop_engine" / "config.pbtxt", *(root / "kvpop_engine" / "configs").glob("*.pbtxt")]:
        text = config.read_text()
        for key, value in (engine_parameters or {}).items():
            text, count = re.subn(
                rf'(key: "{key}" value: {{ string_value: )"[^"]*"', rf'\1"{value}"', text
            )
            assert count == 1, f"parameter {key} not in {config}"
        config.write_text(text)
    return root


@pytest.fixture(scope="session")
def triton_server(tmp_path_factory, tiny_onnx_model_dir):
    root = tmp_path_factory.mktemp("model_repository")
    build_model_repository(root, tiny_onnx_model_dir)
    log_file = tmp_path_factory.mktemp("logs") / "tritonserver.log"
    server = TritonServer(
        model_repository=root,
        http_port=free_port(),
        grpc_port=free_port(),
        metrics_port=free_port(),
        address="127.0.0.1",
        model_config_name="cpu",
        log_file=log_file,
    )
    try:
        with server:
            yield server
    finally:
        if server.process is not None and server.process.returncode not in (0, None):
            print(log_file.read_text()[-5000:])
