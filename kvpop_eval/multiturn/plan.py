"""The test split's pre-registration: the chats, routes, policies, compressions and analysis, fixed in the
tree before the test split first ran, and run once as written (`make eval-multiturn`).

Every design choice (the chats' shape, the reply and answer lengths) was made on the validation split.
The test run regenerates the chats from kvpop_eval.multiturn.chats (seeds "multiturn-v2:test:<index>")
and refuses them unless their sha256 is `tasks_sha256`; its results name the commit of this file.

The analysis, per route: every row's accuracy with its 95% Wilson interval; against the full cache on the
same chats (kvpop_eval.multiturn.analysis) the ratio of accuracies with its 95% paired bootstrap interval
(5,000 resamples, seed 0), the retained share (of the chats the full cache answers, the share the policy
still answers) with its Wilson interval, the paired difference with its bootstrap interval and the chats only
one of the two answers. The criterion: kvpop keeps >= 0.95 of the full cache's accuracy at 88% and >= 0.85
at 94%, on both routes, and answers more chats than keep_start at each compression. Every row is reported.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path

from kvpop_eval.multiturn import runner
from kvpop_eval.multiturn.chats import ChatShape, make_chat

MODEL = Path("model_repository/kvpop_engine/1")


@dataclass(frozen=True)
class Plan:
    split: str
    num: int
    shape: ChatShape
    reply_tokens: int  # at most, a statement turn's reply (the model's own, greedy)
    answer_tokens: int  # at most, the answer to the question
    routes: tuple[str, ...]
    policies: tuple[str, ...]
    compressions: tuple[float, ...]
    tasks_sha256: str


TEST = Plan(split="test", num=120, shape=ChatShape(), reply_tokens=32, answer_tokens=24, routes=runner.ROUTES,
            policies=("full", "kvpop", "keep_start", "streaming"), compressions=(0.88, 0.94), tasks_sha256="")


def commit_of_plan() -> str:
    """The commit that last changed this file: the pre-registration the results stand on."""
    here = Path(__file__).resolve()
    result = subprocess.run(["git", "log", "-1", "--format=%H", "--", here.name], cwd=here.parent, capture_output=True, text=True)
    return result.stdout.strip() or "unknown"


def write_tasks(path: Path, plan: Plan = TEST) -> Path:
    """The plan's chats, refused unless they are the pre-registered ones."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(make_chat(plan.split, index, plan.shape)) + "\n" for index in range(plan.num)))
    digest = runner.sha256(path)
    if digest != plan.tasks_sha256:
        raise ValueError(f"the {plan.split} chats hash to {digest}, not the pre-registered {plan.tasks_sha256}: the "
                         "generator or its pools changed since the pre-registration")
    return path


def run_test(model: Path, out_dir: Path, openai_url: str | None = None, plan: Plan = TEST) -> int:
    """The pre-registered run, every route and row (resumes), then multiturn.json naming the pre-registration."""
    tasks = write_tasks(out_dir / f"chats-{plan.split}.jsonl", plan)
    for route in plan.routes:
        runner.run(route, tasks, list(plan.policies), list(plan.compressions), out_dir, plan.reply_tokens, plan.answer_tokens,
                   model, openai_url)
    extra = {"preregistration": {"commit": commit_of_plan(), **asdict(plan)}}
    summary = runner.report(tasks, out_dir, list(plan.policies), list(plan.compressions), extra, plan.routes)
    return 0 if summary["complete"] else 1
