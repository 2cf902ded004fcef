"""Task files, prompt encoding and answer checks, shared by the harness and the kvpress comparison.

Pure Python on purpose: kvpress_compare imports it from .venv-kvpress (numpy 2, no onnxruntime).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

SWEEP_COMPRESSIONS = (0.0, 0.5, 0.75, 0.88, 0.94)


def load_tasks(path: Path, limit: int | None = None, split: bool = False) -> list[dict]:
    """Every {"prompt", "answer"} line of a JSONL (the first `limit`); `split` (the kvpress +question
    variant) also needs each task's "context" and "question" strings, as kvpop_eval.english_tasks writes."""
    tasks = []
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        record = json.loads(line)
        if "prompt" not in record or "answer" not in record:
            raise ValueError(f"{path}:{number}: every line needs 'prompt' and 'answer' fields")
        tasks.append(record)
    if not tasks:
        raise ValueError(f"{path}: no tasks")
    tasks = tasks[:limit] if limit else tasks
    unsplit = [number for number, task in enumerate(tasks, start=1)
               if not (isinstance(task.get("context"), str) and isinstance(task.get("question"), str))]
    if split and unsplit:
        raise ValueError(f"{path}: --variants question needs 'context' and 'question' strings on every line, as "
                         f"kvpop_eval.english_tasks writes them (lines without: {unsplit[:5]}, {len(unsplit)} in all)")
    return tasks


def scorer(name: str) -> Callable[[str, Any], bool]:
    """`contains`: every item of a (list) answer somewhere in the text; `final_answer`: the reference
    tasks' exact match of the word after "#"."""
    if name == "contains":
        return lambda generated, answer: all(
            str(item).strip() in generated for item in (answer if isinstance(answer, list) else [answer])
        )
    from kvpop_tasks import exact_match

    return lambda generated, answer: exact_match(generated, str(answer))


def task_judge(name: str) -> Callable[[str, dict], bool]:
    """Whether a generated text answers a task: `scorer(name)` on its "answer"; `fact` is `contains` that also
    refuses a text naming any of the task's same-kind "distractors" (a near-miss number, the old value of
    a changed one): an answer that lists every candidate says nothing."""
    if name == "fact":
        contains = scorer("contains")
        return lambda generated, task: contains(generated, task["answer"]) and not any(
            str(item) in generated for item in task.get("distractors", ()))
    check = scorer(name)
    return lambda generated, task: check(generated, task["answer"])


def encode(tokenizer: Any, prompt: str) -> list[int]:
    """The tokenizer's ids with BOS first (the engine's prompt sequence)."""
    ids = list(tokenizer(prompt)["input_ids"])
    bos = getattr(tokenizer, "bos_token_id", None)
    return ids if bos is None or (ids and ids[0] == bos) else [bos, *ids]
