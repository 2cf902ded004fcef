"""Task generator: determinism, exact lengths, and answers checked by an independent evaluator."""

from __future__ import annotations

import dataclasses
import json

import pytest

from kvpop_tasks import TaskConfig, accuracy, exact_match, extract_final_answer, generate_split, generate_task
from kvpop_tasks.__main__ import main as cli_main
from kvpop_tasks.generator import SPLITS, task_seed
from kvpop_tasks.language import WORDS
from kvpop_tasks.solver import asked_name, parse_definitions, solve
from kvpop_train.reference.drills import _SEED_BASE as DRILL_SEED_BASE

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
    assert len({generate_task(config, split, 0).prompt for split in SPLITS}) == len(SPLITS)
    with pytest.raises(ValueError):
        task_seed("dev", 0)


def test_heldout_seed_range_overlaps_no_other_split_and_no_drill() -> None:
    """The headline's held-out split: its whole index range is seeded apart from every other split
    and from the reference model's drills, and adding it moved no older split's seeds."""
    assert SPLITS[:3] == ("train", "validation", "test")  # position fixes the seeds: new splits go last
    assert [task_seed(split, 5) for split in SPLITS[:3]] == [5, 2**40 + 5, 2 * 2**40 + 5]
    ranges = {split: (task_seed(split, 0), task_seed(split, 2**40 - 1)) for split in SPLITS}
    low, high = ranges["heldout"]
    for split, (other_low, other_high) in ranges.items():
        if split != "heldout":
            assert high < other_low or other_high < low, split
    assert high < DRILL_SEED_BASE
    for index in (-1, 2**40):
        with pytest.raises(ValueError):
            task_seed("heldout", index)
    heldout = {generate_task(TaskConfig(context_tokens=2048), "heldout", i).prompt for i in range(20)}
    others = {generate_task(TaskConfig(context_tokens=2048), split, i).prompt for split in SPLITS[:3] for i in range(20)}
    assert len(heldout) == 20 and not heldout & others


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


def test_reasoning_copies_each_fact_and_carries_the_running_offset() -> None:
    task = generate_task(TaskConfig(context_tokens=512, hops=3), "test", 7)
    definitions = parse_definitions(task.prompt)
    lines = [line.split() for line in task.target.split(";")[:-1]]
    name = asked_name(task.prompt)
    offset = 0
    for line in lines[:-1]:  # "name parent operator offset": the fact copied, then the running offset
        assert line[0] == name and tuple(line[1:3]) == definitions[name]
        offset += int(line[2])
        assert line[3] == (f"+{offset}" if offset >= 0 else str(offset))
        name = line[1]
    root = lines[-1]  # "name number result"
    assert root[0] == name and (root[1],) == definitions[name]
    assert int(root[2]) == int(root[1]) + offset
    assert task.target.split()[-2:] == ["#", root[2]]
    assert task.answer == root[2] == str(solve(task.prompt))


def test_fact_positions_point_at_the_defined_names() -> None:
    task = generate_task(TaskConfig(context_tokens=1024, hops=3), "test", 1)
    tokens = ["<bos>"] + task.prompt.split()
    positions = task.questions[0].fact_positions
    names = [tokens[p] for p in positions]
    assert all(tokens[p + 2] == ";" or tokens[p + 3] == ";" for p in positions)  # the name opens its fact
    assert all(tuple(tokens[p + 1 : tokens.index(";", p)]) == parse_definitions(task.prompt)[tokens[p]] for p in positions)
    assert task.questions[0].name in names and len(set(names)) == 4


def test_config_rejects_impossible_knobs() -> None:
    with pytest.raises(ValueError):
        TaskConfig(context_tokens=64, num_facts=40)
    with pytest.raises(ValueError):
        TaskConfig(hops=2, min_hops=3)
    with pytest.raises(ValueError):
        TaskConfig(num_facts=4, hops=3, distractors=1)
    with pytest.raises(ValueError):
        TaskConfig(hops=7)  # running offsets would leave the vocabulary
    assert dataclasses.replace(TaskConfig(), context_tokens=4096).fact_count <= 52


def test_scoring_is_exact_match_of_the_final_answer() -> None:
    assert extract_final_answer("a 3 3 ; # 42") == "42"
    assert extract_final_answer("a 3 3 ;") is None
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
