"""Shared fixtures: one tiny random Llama, built and exported once per test session (~10 s)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_hf_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from export.tiny_model import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny") / "hf")


@pytest.fixture(scope="session")
def tiny_onnx_model_dir(tiny_hf_model_dir: Path) -> Path:
    from export.pipeline import export_model

    output_dir = tiny_hf_model_dir.parent / "onnx"
    export_model(tiny_hf_model_dir, output_dir)
    return output_dir
