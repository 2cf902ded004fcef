"""The English long-context benchmark generator: splits that never overlap, seeded, sized, answerable."""

from __future__ import annotations

import json

import pytest

from benchmarks.english_tasks import FAMILIES, SPLITS, TASK_STATEMENTS, _pool, generate_task, haystack_paragraphs, write_tasks


def count_words(text: str) -> int:
    return len(text.split())


def test_splits_share_no_haystack_paragraph_and_no_name():
    paragraphs = haystack_paragraphs()
    for kind in ("key", "person", "city", "variable"):
        pools = [set(_pool(kind, split)) for split in SPLITS]
        assert all(pools) and not (pools[0] & pools[1] or pools[0] & pools[2] or pools[1] & pools[2])
    sets = [set(paragraphs[split]) for split in SPLITS]
    assert all(len(s) > 50 for s in sets) and not (sets[0] & sets[1] or sets[0] & sets[2] or sets[1] & sets[2])


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_is_seeded_sized_and_holds_its_answer(family):
    task = generate_task(family, "test", 3, 1024, count_words)
    assert task == generate_task(family, "test", 3, 1024, count_words)  # seeded
    assert task != generate_task(family, "test", 4, 1024, count_words)
    assert 1024 * 0.9 <= count_words(task["content"]) <= 1024 * 1.05
    answers = task["answer"] if isinstance(task["answer"], list) else [task["answer"]]
    context, question = task["content"].rsplit("\n\n", 1)
    assert (context, question) == (task["context"], task["question"])
    assert context.startswith(TASK_STATEMENTS[family])  # RULER's shape: what is hidden, then the text
    assert all(answer in context for answer in answers) and not any(answer in question for answer in answers)
    test_paragraphs = set(haystack_paragraphs()["test"])
    body = context.split("\n\n")[1:]
    assert sum(paragraph in test_paragraphs for paragraph in body) >= len(body) - 10  # the rest are needles


def test_the_same_task_differs_between_splits():
    prompts = {split: generate_task("qa", split, 0, 1024, count_words)["content"] for split in SPLITS}
    assert len(set(prompts.values())) == 3


def test_write_tasks_cycles_through_the_families(tmp_path):
    records = write_tasks(tmp_path / "tasks.jsonl", "validation", 10, 1024)
    assert [record["family"] for record in records] == [*FAMILIES, *FAMILIES]
    lines = [json.loads(line) for line in (tmp_path / "tasks.jsonl").read_text().splitlines()]
    assert lines == records and all({"prompt", "answer", "split"} <= set(line) for line in lines)


def test_contains_scoring_needs_every_answer_of_a_list():
    from kvpop.eval import scorer

    is_correct = scorer("contains")
    assert is_correct("The numbers are 111111 and 222222.", ["111111", "222222"])
    assert not is_correct("The number is 111111.", ["111111", "222222"])
    assert is_correct("Paris.", "Paris")


def test_scorer_training_texts_are_generic_english_outside_the_benchmark():
    from kvpop_train.scorer.english_texts import english_texts

    records = english_texts(4)
    assert len(records) == 4 and not any("pydoc_data" in record["source"] for record in records)
    assert all("Question: Which sentence above mentions" in c for record in records for c in record["continuations"])
    shipped = english_texts(4, max_chars=8000, about="value-only", min_values=3)  # the shipped scorers' recipe
    assert any("Which value does the text above give" in c for record in shipped for c in record["continuations"])
    haystack = {paragraph for split in haystack_paragraphs().values() for paragraph in split}
    for record in records + shipped:
        assert record["continuations"] and "pydoc_data" not in record["source"]
        assert not any(paragraph in record["context"] for paragraph in haystack)
        text = " ".join([record["context"], *record["continuations"]])
        assert "pass key" not in text and "special magic number" not in text


def test_more_training_texts_come_from_later_docstrings_and_installed_packages(tmp_path, monkeypatch):
    from kvpop_train.scorer import english_texts as texts

    sentence = "The parser reads {n} records from the stream and returns them as a list of values in order."
    package = tmp_path / "somepkg"
    package.mkdir()
    body = "".join(f'def f{i}():\n    """{sentence.format(n=10 + i)}"""\n\n' for i in range(60))
    (package / "__init__.py").write_text(f'"""{sentence.format(n=99)}"""\n' + body)
    monkeypatch.syspath_prepend(str(tmp_path))
    found = texts.package_docstrings(["somepkg"])
    assert list(found) == ["somepkg.__init__"] and len(found["somepkg.__init__"]) == 61  # module + 60 functions
    runs = texts._runs(found["somepkg.__init__"], max_chars=2500)
    assert len(runs) > 1 and all(len(run) <= 2500 for run in runs)
    assert "\n\n".join(runs).split("\n\n") == found["somepkg.__init__"]  # consecutive, nothing lost
    with pytest.raises(ValueError, match="not an installed package"):
        texts.package_docstrings(["os"])  # a module, not a package
    monkeypatch.setattr(texts, "stdlib_docstrings", lambda: {})  # only the package's texts
    records = texts.english_texts(10, max_chars=2500, windows=3, packages={"somepkg": 5}, about="value-only", min_values=3)
    long_enough = [i for i, run in enumerate(runs[:3]) if len(run) >= 2000]  # shorter contexts are skipped
    assert len(long_enough) >= 2
    assert sorted(record["source"] for record in records) == ["somepkg.__init__" + (f"#{i}" if i else "") for i in long_enough]
    assert sorted(record["context"] for record in records) == sorted(runs[i] for i in long_enough)
    assert len(texts.english_texts(10, max_chars=2500, windows=3, packages={"somepkg": 1}, min_values=3)) == 1  # its quota


def test_value_questions_ask_for_every_sentence_that_states_a_value():
    import random

    from kvpop_train.scorer.english_texts import recall_questions

    context = ("The default port number is 8021 for this service. Connections are opened lazily by the client. "
               "The encoding defaults to 'latin-1' unless another one is configured. Nothing else is remembered "
               "between two separate calls of the function.")
    asked = recall_questions(context, random.Random(0), count=3, about="values")
    assert len(asked) == 3 and any("8021" in q for q in asked) and any("'latin-1'" in q for q in asked)
    only = recall_questions(context, random.Random(0), count=2, about="value-only")
    assert sorted(q.rsplit("Answer: ", 1)[1] for q in only) == ["'latin-1'", "8021"]
    assert all("Which value does the text above give" in q for q in only)
    with pytest.raises(ValueError):
        recall_questions(context, random.Random(0), count=2, about="numbers")


def test_sweeps_of_the_same_tasks_merge_into_one_table(tmp_path):
    import json

    from kvpop.eval import merge_sweeps

    def row(policy, compression, accuracy, seconds):
        return {"policy": policy, "compression": compression, "accuracy": accuracy, "compression_achieved": compression,
                "mean_budget": 10, "max_peak_kv_bytes": 1, "generated_tokens_per_s": 1.0, "tasks": 4,
                "seconds": seconds, "correct_by_task": "1100" if accuracy == 0.5 else "1111"}

    header = {"tasks": 4, "scoring": "contains", "tasks_file": "t.jsonl", "tasks_sha256": "abc"}
    first, second = tmp_path / "heuristics", tmp_path / "learned"
    for folder, rows in ((first, [row("full", 0.0, 1.0, 5), row("h2o", 0.88, 0.5, 7)]),
                         (second, [row("full", 0.0, 0.5, 9), row("kvpop:mlp", 0.88, 1.0, 8)])):
        folder.mkdir()
        (folder / "sweep.json").write_text(json.dumps({**header, "results": rows}))
    summary = merge_sweeps([first, second], tmp_path / "merged")
    assert [(r["policy"], r["compression"], r["accuracy"]) for r in summary] == [
        ("full", 0.0, 1.0), ("h2o", 0.0, 1.0), ("h2o", 0.88, 0.5), ("kvpop:mlp", 0.0, 1.0), ("kvpop:mlp", 0.88, 1.0)
    ]  # the first sweep's full cache, copied into each policy's 0% cell
    table = (tmp_path / "merged" / "sweep.md").read_text()
    assert "Wall seconds per run" in table and "| kvpop:mlp | - | 8 |" in table
    (second / "sweep.json").write_text(json.dumps({**header, "tasks_sha256": "other", "results": []}))
    with pytest.raises(ValueError, match="different"):
        merge_sweeps([first, second], tmp_path / "merged")
