"""Task generator: determinism, exact lengths, and answers checked by an independent evaluator."""

from __future__ import annotations

import dataclasses
import json

import pytest

from kvpop.tasks import TaskConfig, accuracy, exact_match, extract_final_answer, generate_split, generate_task
from kvpop.tasks.__main__ import main as cli_main
from kvpop.tasks.generator import task_seed
from kvpop.tasks.language import WORDS
from kvpop.tasks.solver import asked_name, parse_definitions, solve

CONFIGS = [
    TaskConfig(context_tokens=512, hops=3),
    TaskConfig(context_tokens=1024, hops=3),
    TaskConfig(context_tokens=4096, hops=3),
    TaskConfig(context_tokens=64, hops=0, num_facts=8, distractors=0, questions=6),
    TaskConfig(context_tokens=256, hops=3, min_hops=0, num_facts=24, questions=3),
]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{c.context_tokens}-h{c.hops}-q{c.questions}")
def test_same_seed_same_task_and_other_index_differs(config: TaskConfig) -> None:
    assert generate_task(config, "test", 3) == generate_task(config, "test", 3)
    assert generate_task(config, "test", 3).prompt != generate_task(config, "test", 4).prompt


def test_splits_use_disjoint_seeds() -> None:
    seeds = {split: {task_seed(split, i) for i in (0, 1, 2**40 - 1)} for split in ("train", "validation", "test")}
    assert not seeds["train"] & seeds["validation"] and not seeds["validation"] & seeds["test"]
    assert not seeds["train"] & seeds["test"]
    config = TaskConfig()
    assert len({generate_task(config, split, 0).prompt for split in ("train", "validation", "test")}) == 3
    with pytest.raises(ValueError):
        task_seed("dev", 0)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{c.context_tokens}-h{c.hops}-q{c.questions}")
def test_prompt_has_exactly_the_requested_length_in_the_closed_vocabulary(config: TaskConfig) -> None:
    for task in generate_split(config, "validation", 5):
        words = task.prompt.split()
        assert 1 + len(words) == config.context_tokens  # + BOS
        assert set(words) | set(task.target.split()) <= set(WORDS)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{c.context_tokens}-h{c.hops}-q{c.questions}")
def test_independent_evaluator_agrees_with_every_answer(config: TaskConfig) -> None:
    for task in generate_split(config, "test", 20):
        definitions = parse_definitions(task.prompt)  # raises if a name were defined twice
        assert len(definitions) == config.fact_count
        for question in task.questions:
            prompt = " ".join(task.context + ("?", question.name, ":"))
            assert solve(prompt) == question.answer
            assert extract_final_answer(" ".join(question.reasoning)) == str(question.answer)


def test_reasoning_looks_up_exactly_the_chain_and_computes_it_forward() -> None:
    task = generate_task(TaskConfig(context_tokens=512, hops=3), "test", 7)
    definitions = parse_definitions(task.prompt)
    steps = [step.split() for step in task.target.split(";")[:-1]]
    name = asked_name(task.prompt)
    lookups = steps[:4]
    for step in lookups:  # backward: "name = rhs" copied from the context
        assert step[0] == name and step[1] == "="
        assert tuple(step[2:]) == definitions[name]
        name = step[2]
    value = int(lookups[-1][2])
    for step in steps[4:]:  # forward: "name = previous op = result"
        assert int(step[2]) == value
        value = value + int(step[3])
        assert int(step[5]) == value
    assert task.answer == str(value) == str(solve(task.prompt))


def test_fact_positions_point_at_the_defined_names() -> None:
    task = generate_task(TaskConfig(context_tokens=1024, hops=3), "test", 1)
    tokens = ["<bos>"] + task.prompt.split()
    names = [tokens[p] for p in task.questions[0].fact_positions]
    assert all(tokens[p + 1] == ";" and tokens[p - 1] == "=" for p in task.questions[0].fact_positions)
    assert task.questions[0].name in names and len(set(names)) == 4


def test_config_rejects_impossible_knobs() -> None:
    with pytest.raises(ValueError):
        TaskConfig(context_tokens=64, num_facts=40)
    with pytest.raises(ValueError):
        TaskConfig(hops=2, min_hops=3)
    with pytest.raises(ValueError):
        TaskConfig(num_facts=4, hops=3, distractors=1)
    assert dataclasses.replace(TaskConfig(), context_tokens=4096).fact_count <= 52


def test_scoring_is_exact_match_of_the_final_answer() -> None:
    assert extract_final_answer("a = 3 ; # 42") == "42"
    assert extract_final_answer("a = 3 ;") is None
    assert exact_match("x # 7 # 8", "7") and not exact_match("# 70", "7")
    assert accuracy(["# 1", "# 2"], ["1", "3"]) == 0.5


def test_cli_writes_one_json_task_per_line(tmp_path) -> None:
    out = tmp_path / "test.jsonl"
    assert cli_main(["write", "--split", "test", "--num", "3", "--context-tokens", "512", "--out", str(out)]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 3
    assert records[0]["prompt"] == generate_task(TaskConfig(context_tokens=512), "test", 0).prompt
    assert all(str(solve(r["prompt"])) == r["answer"] and r["prompt_tokens"] == 512 for r in records)


def test_name_pool_restricts_the_names() -> None:
    task = generate_task(TaskConfig(context_tokens=64, hops=0, num_facts=8, distractors=0, questions=4, name_pool=8), "train", 0)
    assert set(parse_definitions(task.prompt)) == set("abcdefgh")
