"""Answer retention (kvpop_eval.quality.retention): which answers survive the prompt's eviction, on the tiny export."""

from __future__ import annotations

import json

import numpy as np

from kvpop_eval.quality.retention import answer_occurrences, main as retention_main, task_retention

FILLER = " ".join(["the river runs past the old mill and the town"] * 8)


def test_a_retained_answer_is_held_by_every_cache():
    positions = np.array([[[0, 1, 5, 6], [0, 1, 5, -1]], [[0, 1, 5, 6], [0, 1, 5, 6]]])  # (L=2, Hkv=2, C=4)
    assert task_retention(positions, [[np.array([5, 6])]]).retained is False  # one cache lacks position 6
    kept = task_retention(positions, [[np.array([5])]])
    assert kept.found and kept.retained and kept.token_share == 1.0
    some = task_retention(positions, [[np.array([2, 3]), np.array([5, 6])]])  # two occurrences: the best one counts
    assert not some.retained and some.token_share == 7 / 8
    assert not task_retention(positions, [[np.array([5])], []]).found  # an item missing from the prompt


def test_answer_occurrences_are_the_answers_tokens(tiny_onnx_model_dir):
    from transformers import AutoTokenizer

    from kvpop_eval.quality import encode

    tokenizer = AutoTokenizer.from_pretrained(tiny_onnx_model_dir / "tokenizer")
    prompt = f"{FILLER} The code is 4217. {FILLER} Again: 4217."
    ids = encode(tokenizer, prompt)
    (found,) = answer_occurrences(tokenizer, prompt, ids, "4217")
    assert len(found) == 2 and all("4217" in tokenizer.decode([ids[p] for p in positions]) for positions in found)


def test_streaming_keeps_the_answer_at_the_end_and_loses_the_one_in_the_middle(tiny_onnx_model_dir, tmp_path):
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps(task) + "\n" for task in [
        {"prompt": f"{FILLER} The code is 4217. {FILLER}", "answer": "4217"},
        {"prompt": f"{FILLER} {FILLER} The code is 4217.", "answer": "4217"},
        {"prompt": FILLER, "answer": "9999"},
    ]))
    out = tmp_path / "retention"
    assert retention_main(["--model", str(tiny_onnx_model_dir), "--tasks", str(tasks), "--policies", "streaming",
                           "--compressions", "0.75", "--max-tokens", "2", "--sinks", "2", "--window", "8",
                           "--out-dir", str(out)]) == 0
    (row,) = json.loads((out / "retention.json").read_text())["results"]
    assert row["retained_by_task"] == "01-" and (row["found"], row["retained"]) == (2, 1)
    assert "| streaming | 1/2 (0.50) |" in (out / "retention.md").read_text()
    assert (out / "retention_vs_compression.png").stat().st_size > 0
