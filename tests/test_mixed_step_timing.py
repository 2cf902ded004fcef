"""benchmarks/mixed_step_timing.py on the tiny exported model: it runs and reports every case."""

from __future__ import annotations

import json

from benchmarks import mixed_step_timing


def test_mixed_step_timing_reports_each_kind_of_work(tiny_onnx_model_dir, tmp_path):
    out = tmp_path / "mixed.json"
    assert mixed_step_timing.main(["--model", str(tiny_onnx_model_dir), "--out", str(out), "--repetitions", "1",
                                   "--batch", "2", "--slots", "8", "--piece-tokens", "3", "5"]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(row["work"], row["piece_tokens"]) for row in rows] == [
        ("decode", 0), ("piece", 3), ("decode + piece", 3), ("piece", 5), ("decode + piece", 5)]
    assert all(row["separate_or_lean_ms"] > 0 and row["mixed_ms"] > 0 for row in rows)
    assert out.with_suffix(".md").read_text().count("\n| ") == 6  # separator + five rows
