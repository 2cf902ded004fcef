"""Where the exporter finds a model's trained scorers, and re-exporting only them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from export.pipeline import SHIPPED_SCORERS, ExportError, export_scorers_only, scorer_dir_for


def test_scorers_beside_the_model_win_over_the_shipped_ones(tmp_path):
    model = tmp_path / "smollm2-135m-instruct"
    model.mkdir()
    assert scorer_dir_for(model) == SHIPPED_SCORERS / "smollm2-135m-instruct"  # a git-ignored model dir
    (model / "scorer").mkdir()
    assert scorer_dir_for(model) == model / "scorer"  # the reference model's layout


def test_scorers_only_reexport_updates_the_report(tiny_hf_model_dir, tiny_onnx_model_dir, tmp_path):
    export = tmp_path / "export"
    shutil.copytree(tiny_onnx_model_dir, export)
    for scorer in export.glob("scorer_*"):
        scorer.unlink()
    report = export_scorers_only(tiny_hf_model_dir, export)
    assert set(report["scorers"]) == {"scorer_mlstm.onnx", "scorer_mlp.onnx"}
    assert all((export / name).exists() for name in report["scorers"])
    assert all(result["passed"] for result in report["scorers"].values())
    assert json.loads((export / "export_report.json").read_text())["scorers"] == report["scorers"]
    with pytest.raises(ExportError, match="not of"):
        export_scorers_only(Path(tmp_path / "another-model"), export)
