"""Shared fixtures: one tiny random Llama with a briefly trained KVpop scorer, built and exported once
per test session (~20 s)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_hf_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from export.tiny_model import build_tiny_llama
    from kvpop_train.scorer.train import main as train_scorer

    model_dir = build_tiny_llama(tmp_path_factory.mktemp("tiny") / "hf")
    # A few steps are enough to exercise the learned scorer end to end (not to make it good). Window 8:
    # the tests' budgets of 12-24 slots then keep long-range slots for the scorer to decide (with the
    # default 64 they would be all sinks + window, where the policy never consults it).
    train_scorer(["--model", str(model_dir), "--steps", "30", "--num-texts", "8", "--max-tokens", "256", "--threads", "1",
                  "--window", "8"])
    return model_dir


@pytest.fixture(scope="session")
def tiny_onnx_model_dir(tiny_hf_model_dir: Path) -> Path:
    from export.pipeline import export_model

    output_dir = tiny_hf_model_dir.parent / "onnx"
    export_model(tiny_hf_model_dir, output_dir)
    return output_dir


@pytest.fixture(scope="session")
def decoder(tiny_onnx_model_dir):
    """The tiny model's decoder step, one onnxruntime thread (shared: it keeps no per-request state)."""
    from kvpop.decoder import DecoderStep

    return DecoderStep(tiny_onnx_model_dir, threads=1)


REFERENCE_MODEL = Path(__file__).resolve().parents[1] / "models" / "reference"


@pytest.fixture(scope="session")
def reference_onnx_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shipped reference model, exported once per session (skipped in a checkout without it)."""
    if not (REFERENCE_MODEL / "model.safetensors").exists():
        pytest.skip("no shipped reference model in models/reference")
    from export.pipeline import export_model

    output_dir = tmp_path_factory.mktemp("reference") / "onnx"
    export_model(REFERENCE_MODEL, output_dir)
    return output_dir
