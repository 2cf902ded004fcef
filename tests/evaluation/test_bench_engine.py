"""kvpop_eval.bench.engine steady on the tiny exported model: the timed steps run with every cache full."""

from __future__ import annotations

import json

from kvpop_eval.bench.engine import steady as steady_decode


def test_steady_decode_times_full_caches_and_splits_off_the_decoder(tiny_onnx_model_dir, tmp_path):
    out = tmp_path / "steady.json"
    assert steady_decode.main(["--model", str(tiny_onnx_model_dir), "--budget", "16", "--streams", "2",
                               "--prompt-tokens", "24", "--fill", "12", "--steps", "4", "--no-server",
                               "--out", str(out)]) == 0
    engine = json.loads(out.read_text())["engine"]
    assert engine["caches_full"] and engine["streams"] == 2 and engine["budget"] == 16
    assert 0 < engine["decoder_ms_per_step"] <= engine["step_ms_mean"]


def test_the_overhead_systems_turn_the_question_pick_off_only_where_asked():
    from kvpop_eval.bench.engine.overhead import systems

    table = systems(["mlp", "mlstm"], 0.88, query_aware=("mlstm",))
    assert set(table) == {"full", "kvpop:mlp", "kvpop:mlp per-sequence", "kvpop:mlstm", "kvpop:mlstm per-sequence",
                          "kvpop:mlstm+noquery"}
    without_pick, vectorised = table["kvpop:mlstm+noquery"]
    assert vectorised and without_pick.options.query_window == 0 and without_pick.options.scorer == "mlstm"
    assert table["kvpop:mlstm"][0].options.query_window != 0
