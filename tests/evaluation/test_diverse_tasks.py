"""The diverse suite: sources split without overlap, held-out sources only in test, facts as the record says,
distractors that the `fact` scoring refuses, and the pre-registered analysis."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from kvpop_eval import text_sources
from kvpop_eval.diverse_tasks import FAMILIES, generate_task
from kvpop_eval.quality.analysis import analyse, cell_statistics
from kvpop_eval.quality.tasks_io import task_judge


def count_tokens(text: str) -> int:
    return max(1, len(text) // 4)


@pytest.mark.parametrize("source", ["reference", "code", "report"])
def test_a_sources_splits_share_no_block(source):
    validation, test = text_sources.blocks(source, "validation"), text_sources.blocks(source, "test")
    assert len(validation) > 20 and len(test) > 20 and not set(validation) & set(test)


def test_held_out_sources_have_no_validation_blocks():
    for source in text_sources.HELD_OUT:
        with pytest.raises(ValueError, match="held out"):
            text_sources.blocks(source, "validation")


@pytest.mark.parametrize("index", range(10))
def test_a_task_holds_its_facts_and_asks_one(index):
    sources = ("reference", "code", "report")
    task = generate_task(index, "validation", 2048, count_tokens, sources)
    assert task["source"] == sources[index % 3] and task["family"] == FAMILIES[(index // 3) % len(FAMILIES)]
    answers = task["answer"] if isinstance(task["answer"], list) else [task["answer"]]
    assert all(answer in task["content"] for answer in answers)
    assert all(distractor in task["content"] for distractor in task["distractors"])
    assert not any(distractor in answer or answer in distractor for distractor in task["distractors"] for answer in answers)
    assert task["content"].endswith(task["question"]) and 1800 <= count_tokens(task["content"]) <= 2100
    assert generate_task(index, "validation", 2048, count_tokens, sources) == task  # seeded


def test_fact_scoring_refuses_an_answer_that_names_a_distractor():
    judge = task_judge("fact")
    task = {"answer": "4821", "distractors": ["4921"]}
    assert judge("The code is 4821.", task)
    assert not judge("It was 4921, now 4821.", task)
    assert not judge("The code is 4921.", task)
    assert task_judge("fact")("Both: 12 and willow.", {"answer": ["12", "willow"]})


def test_ratio_interval_and_retained_share():
    full = np.array([True] * 8 + [False] * 2)
    cell = np.array([True] * 7 + [False] + [True, False])
    stats = cell_statistics(cell, full, in_cache=np.array([True] * 7 + [False, True, True]))
    assert stats["ratio"] == pytest.approx(1.0) and stats["retained"] == pytest.approx(7 / 8)
    assert stats["ratio_interval"][0] < 1.0 < stats["ratio_interval"][1]
    assert (stats["gained"], stats["lost"], stats["lost_in_cache"]) == (1, 1, 1)
    records = [{"family": "single" if i % 2 else "pair", "cells": {"full@0": {"correct": bool(f), "in_cache": True},
                                                                     "kvpop@0.88": {"correct": bool(c), "in_cache": True}}}
               for i, (f, c) in enumerate(zip(full, cell))]
    result = analyse(records)
    assert set(result) == {"all", "family=single", "family=pair"} and result["all"]["kvpop@0.88"]["tasks"] == 10
    json.dumps(result)


def test_a_plan_reads_its_pieces_in_line_order_up_to_the_first_unfinished(tmp_path):
    from kvpop_eval.quality.plan import check_tasks, finished_runs

    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"index": i, "answer": str(i)}) + "\n" for i in range(6)))
    plan = {"results": str(tmp_path / "results"),
            "task_files": [{"path": str(tasks), "sha256": hashlib.sha256(tasks.read_bytes()).hexdigest()}],
            "pieces": [{"piece": n + 1, "tasks": str(tasks), "lines": f"{2 * n + 1}:{2 * n + 2}",
                        "policies": ["kvpop:mlstm", "h2o"] if n == 0 else ["kvpop:mlstm"]} for n in range(3)]}
    check_tasks(plan)
    for number, done in ((1, 2), (2, 1), (3, 2)):  # piece 2 stopped after one task: piece 3 is not read
        folder = tmp_path / "results" / f"piece-{number:02d}"
        folder.mkdir(parents=True)
        (folder / "tasks.jsonl").write_text("{}\n" * done)
    runs, count = finished_runs(plan, str(tasks))
    assert [run.name for run in runs] == ["piece-01", "piece-02"] and count == 3
    runs, count = finished_runs(plan, str(tasks), ("h2o",))
    assert [run.name for run in runs] == ["piece-01"] and count == 2
    tasks.write_text(tasks.read_text() + "\n")
    with pytest.raises(ValueError, match="not the registered tasks"):
        check_tasks(plan)


ROOT = Path(__file__).resolve().parents[2]
SMOLLM = ROOT / "models" / "smollm2-135m-instruct"


def test_the_packages_make_model_adds_are_those_left_out_of_the_readme_source():
    pins = (ROOT / "requirements" / "real-model.txt").read_text().splitlines()
    names = {line.split("==")[0].strip().lower() for line in pins if line.strip() and not line.startswith("#")}
    assert names == text_sources.MODEL_BUILD_PACKAGES
    assert not {name.lower() for name, _ in text_sources._metadata_descriptions()} & text_sources.MODEL_BUILD_PACKAGES


def test_the_sources_read_the_environments_packages_not_whatever_is_on_sys_path(tmp_path, monkeypatch):
    """Importing pkg_resources puts setuptools' vendored packages on sys.path; the sources must not change."""
    before = text_sources._metadata_descriptions()
    stray = tmp_path / "stray_package-1.0.dist-info"
    stray.mkdir()
    (stray / "METADATA").write_text("Metadata-Version: 2.1\nName: stray-package\nVersion: 1.0\n\n" + "A paragraph. " * 400)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert text_sources._metadata_descriptions() == before


@pytest.mark.skipif(not (SMOLLM / "tokenizer.json").exists(), reason="needs models/smollm2-135m-instruct (make model)")
def test_the_published_validation_tasks_are_written_again(tmp_path):
    """The validation run on record names its tasks file's digest: `make setup`'s environment writes the same
    file whether or not `make model` has added its packages since."""
    from kvpop_eval.diverse_tasks import write_tasks

    published = json.loads((ROOT / "docs" / "results" / "diverse-validation-2048.json").read_text())
    out = tmp_path / "validation-2048.jsonl"
    write_tasks(out, "validation", published["tasks"], 2048, SMOLLM)
    assert hashlib.sha256(out.read_bytes()).hexdigest() == published["tasks_sha256"]
