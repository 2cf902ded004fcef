"""Prefill once, evict many: the same answers as the per-cell harness, whole-prompt attention for H2O/TOVA,
a run that resumes, and pieces that join with `--concat`."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvpop.cache.slot_cache import SlotCache
from kvpop.request import CacheConfig, GenerationRequest
from kvpop.sampling import SamplingParams
from kvpop_eval.engine_factory import build_engine
from kvpop_eval.quality.harness import evaluate, policy_config
from kvpop_eval.quality.prefill_once import main as prefill_once_main
from kvpop_eval.quality.prefill_once import prefill
from kvpop_eval.quality.report import concat_sweeps

WORDS = "alpha beta gamma delta omega sigma kappa lambda theta zeta".split()
# Policies whose per-cell path is the one replayed here (prompt whole, or chunks of the full cache).
SAME_PATH = ["streaming", "random", "keep_start", "snapkv", "kvpop:mlstm", "kvpop:mlstm+noquery",
             "kvpop:mlstm+recency"]


def _tasks(count: int) -> list[dict]:
    rng = np.random.default_rng(3)
    tasks = []
    for index in range(count):
        words = " ".join(rng.choice(WORDS, size=70))
        code = str(rng.integers(100, 999))
        tasks.append({"index": index, "prompt": f"Notes. {words}. The code is {code}. {words[:90]}. What is the code?",
                      "answer": code})
    return tasks


@pytest.fixture(scope="module")
def engines(tiny_onnx_model_dir):
    """A per-cell engine as `kvpop_eval.quality` builds it (prompts whole, batch 1: pieces as run alone), and one for
    the prefill-once harness; both cut prompts into 16-token pieces."""
    per_cell = build_engine(tiny_onnx_model_dir, max_batch_size=1, prefill_chunk=16, whole_prompt_tokens=8192)
    once = build_engine(tiny_onnx_model_dir, max_batch_size=8, prefill_chunk=16)
    return per_cell, once


def test_answers_are_the_per_cell_harness_answers(engines, tmp_path):
    per_cell, once = engines
    tasks = _tasks(3)
    path = tmp_path / "tasks.jsonl"
    path.write_text("".join(json.dumps(task) + "\n" for task in tasks))
    out = tmp_path / "once"
    assert prefill_once_main(["--model", str(once.decoder.model_dir), "--tasks", str(path), "--policies", ",".join(SAME_PATH),
                              "--compressions", "0.5,0.75", "--max-tokens", "6", "--sinks", "2", "--window", "4",
                              "--prefill-chunk", "16", "--out-dir", str(out)]) == 0
    records = [json.loads(line) for line in (out / "tasks.jsonl").read_text().splitlines()]
    assert len(records) == 3
    for policy in ["full", *SAME_PATH]:
        for ratio in ((0.0,) if policy == "full" else (0.5, 0.75)):
            config = CacheConfig(policy="full") if policy == "full" else policy_config(policy, ratio, sinks=2, window=4)
            report = evaluate(per_cell, tasks, config, max_tokens=6, scoring="contains")
            expected = [row["generated"] for row in report["rows"]]
            got = [record["cells"][f"{policy}@{ratio:g}"]["generated"] for record in records]
            assert got == expected, (policy, ratio)
            budgets = [record["cells"][f"{policy}@{ratio:g}"]["budget"] for record in records]
            assert budgets == [row["budget"] for row in report["rows"]]
    sweep = json.loads((out / "sweep.json").read_text())
    assert sweep["complete"] and {row["policy"] for row in sweep["results"]} == {"full", *SAME_PATH}
    assert all(len(row["in_cache_by_task"]) == 3 for row in sweep["results"])


def test_h2o_is_scored_on_every_prompt_query_and_tova_on_the_last(engines):
    """The whole prompt's attention: H2O keeps the tokens every query attended to most, TOVA those the prompt's
    last query attended to most (outside what each protects)."""
    _, once = engines
    prompt_ids = [1, *range(5, 85)]
    prompt = prefill(once, prompt_ids, query_window=8, accumulate=True)
    assert prompt.prompt_attention.shape == (once.spec.num_layers, once.spec.num_attention_heads, 80 + 1)
    # each query's attention sums to 1, so every prompt query together gives as much as there are queries
    np.testing.assert_allclose(prompt.prompt_attention.sum(axis=-1), len(prompt_ids), rtol=1e-4)
    from kvpop_eval.quality.prefill_once import branch

    for name, statistic in (("h2o", prompt.prompt_attention), ("tova", prompt.query_attention[:, :, -1])):
        config = CacheConfig(policy=name, budget=30, options=dict(window=4))
        cache = branch(once, prompt, config, max_tokens=4)
        group = once.spec.query_heads_per_kv_head
        worth = statistic.reshape(once.spec.num_layers, once.spec.num_kv_heads, group, -1).sum(axis=2)  # (L, Hkv, P)
        protected = 4 if name == "h2o" else 0
        for layer in range(once.spec.num_layers):
            for head in range(once.spec.num_kv_heads):
                held = set(cache.position[layer, head, : cache.length].tolist())
                ranked = np.argsort(-worth[layer, head, : len(prompt_ids) - protected], kind="stable")
                assert set(ranked[: 30 - protected].tolist()) | set(range(len(prompt_ids) - protected, len(prompt_ids))) == held


def test_a_run_resumes_and_its_pieces_concatenate(engines, tmp_path):
    _, once = engines
    tasks = _tasks(4)
    path = tmp_path / "tasks.jsonl"
    path.write_text("".join(json.dumps(task) + "\n" for task in tasks))
    common = ["--model", str(once.decoder.model_dir), "--tasks", str(path), "--policies", "h2o,tova,streaming",
              "--compressions", "0.5", "--max-tokens", "4", "--sinks", "2", "--window", "4", "--prefill-chunk", "16"]
    assert prefill_once_main([*common, "--lines", "1:2", "--out-dir", str(tmp_path / "a")]) == 0
    assert prefill_once_main([*common, "--lines", "3:4", "--out-dir", str(tmp_path / "b")]) == 0
    finished = (tmp_path / "b" / "tasks.jsonl").read_text()
    (tmp_path / "b" / "tasks.jsonl").write_text(finished.splitlines(keepends=True)[0])  # cut short after one task
    assert prefill_once_main([*common, "--lines", "3:4", "--out-dir", str(tmp_path / "b")]) == 0
    assert (tmp_path / "b" / "tasks.jsonl").read_text() .splitlines()[0] == finished.splitlines()[0]
    assert len((tmp_path / "b" / "tasks.jsonl").read_text().splitlines()) == 2
    joined = concat_sweeps([tmp_path / "a", tmp_path / "b"], path, tmp_path / "all")
    assert {row["tasks"] for row in joined} == {4}


def test_the_engine_refuses_a_cache_that_does_not_hold_the_prompt(engines):
    _, once = engines
    config = CacheConfig(policy="streaming", budget=8)
    cache = SlotCache(once.spec, config.build_policy(), 8)
    with pytest.raises(ValueError, match="seen 0 tokens"):
        once.add_prefilled(GenerationRequest("x", [1, 2, 3], SamplingParams(max_tokens=2), config), cache, 5)
