"""benchmarks/step_cost.py on the tiny exported model: it runs, and its fit describes its medians."""

from __future__ import annotations

import json

from benchmarks import step_cost


def test_step_cost_writes_medians_and_a_linear_fit_per_batch(tiny_onnx_model_dir, tmp_path):
    out = tmp_path / "step_cost.json"
    assert step_cost.main(["--model", str(tiny_onnx_model_dir), "--out", str(out), "--repetitions", "1",
                           "--batches", "1", "2", "--slots", "8", "64"]) == 0
    report = json.loads(out.read_text())
    assert {(cell["batch"], cell["slots"]) for cell in report["median_ms"]} == {(1, 8), (1, 64), (2, 8), (2, 64)}
    assert all(cell["ms"] > 0 for cell in report["median_ms"])
    for batch in ("1", "2"):  # two points: the line goes through both
        fit = report["fit"][batch]
        for cell in (c for c in report["median_ms"] if str(c["batch"]) == batch):
            assert abs(fit["base_ms"] + fit["per_slot_ms"] * cell["slots"] - cell["ms"]) < 1e-6 * max(1.0, cell["ms"])
    assert out.with_suffix(".md").read_text().count("\n| ") == 3  # separator + two batch rows


def test_step_cost_times_the_exported_scorers_decode_batch_graph(tiny_onnx_model_dir, tmp_path):
    from kvpop.scorer.runtime import ScorerRuntime

    out = tmp_path / "step_cost.json"
    step_cost.main(["--model", str(tiny_onnx_model_dir), "--out", str(out), "--repetitions", "1",
                    "--batches", "1", "2", "--slots", "8", "64"])
    kinds = [kind for kind in ScorerRuntime.available(tiny_onnx_model_dir)
             if ScorerRuntime(tiny_onnx_model_dir, kind).decode_session is not None]
    timed = json.loads(out.read_text())["scorer_decode_batch_ms"]
    assert {(cell["kind"], cell["batch"]) for cell in timed} == {(kind, batch) for kind in kinds for batch in (1, 2)}
    assert all(cell["ms"] > 0 for cell in timed)
