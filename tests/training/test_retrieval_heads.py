"""Retrieval-head calibration (kvpop_train.scorer.retrieval_heads) on the tiny local model."""

from __future__ import annotations

import json
import random

from kvpop_train.scorer.english_texts import split_sentences
from kvpop_train.scorer.retrieval_heads import calibration_prompts, main

CONTEXT = " ".join(f"Sentence number {index} of the text talks about the weather in some town." for index in range(12))


def test_facts_are_planted_inside_the_running_text_and_one_is_asked():
    (message, asked), = calibration_prompts({"context": CONTEXT}, random.Random(0), per_context=1)
    text, _, question = message.rpartition("\n\n")
    planted = [sentence for sentence in split_sentences(text) if sentence.startswith("The ")]
    assert len(planted) == 3 and asked in planted
    assert "\n" not in text and not text.startswith("The ") and not text.endswith(planted[-1])  # text on both sides
    name = asked.split(" of ", 1)[1].rsplit(" is ", 1)[0]
    assert question.startswith("What is the ") and f" of {name}?" in question


def test_calibration_writes_the_best_heads(tiny_hf_model_dir, tmp_path):
    texts = tmp_path / "texts.jsonl"
    texts.write_text(json.dumps({"context": CONTEXT}) + "\n")
    main(["--model", str(tiny_hf_model_dir), "--texts", str(texts), "--out", str(tmp_path), "--contexts", "1",
          "--per-context", "2", "--heads", "2", "--query-window", "8", "--threads", "1"])
    result = json.loads((tmp_path / "retrieval_heads.json").read_text())
    rates = result["hit_rate_all"]  # (L, Hkv)
    assert result["questions"] == 2 and len(result["heads"]) == 2
    assert all(0.0 <= rate <= 1.0 for row in rates for rate in row)
    assert result["hit_rate"] == sorted(result["hit_rate"], reverse=True)
    assert [rates[layer][head] for layer, head in result["heads"]] == result["hit_rate"]
