"""The test split's pre-registration: the chats (generator, seeds, count, shape, sha256), the routes, policies,
compressions, the order they run in and the analysis, fixed in docs/results/preregistration-multiturn.json
before the first test chat ran, then run once as written (`make eval-multiturn`).

Every design choice (the chats' shape, the reply and answer lengths) was made on the validation split. The
run regenerates the chats from kvpop_eval.multiturn.chats (seeds "multiturn-v2:test:<index>") and refuses
them unless their sha256 is the registered one; its results name the commits of the plan file.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path

from kvpop_eval.multiturn import runner
from kvpop_eval.multiturn.chats import ChatShape, make_chat

PLAN = Path("docs/results/preregistration-multiturn.json")


def load_plan(path: Path = PLAN) -> dict:
    return {**json.loads(Path(path).read_text()), "file": str(path)}


def registration_commits(path: Path) -> list[str]:
    """Every commit of the plan file, the registration first: what the results name as their pre-registration."""
    try:
        found = subprocess.run(["git", "log", "--format=%H", "--", str(path)], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return []
    return found.stdout.split()[::-1]


def chats_text(split: str, num: int, shape: ChatShape) -> str:
    return "".join(json.dumps(make_chat(split, index, shape)) + "\n" for index in range(num))


def write_tasks(plan: dict) -> Path:
    """The plan's chats at the plan's path, refused unless they are the registered ones."""
    tasks = plan["tasks"]
    text = chats_text(tasks["split"], tasks["num"], ChatShape(**tasks["shape"]))
    digest = hashlib.sha256(text.encode()).hexdigest()
    if digest != tasks["sha256"]:
        raise ValueError(f"the {tasks['split']} chats hash to {digest}, not the registered {tasks['sha256']}: the generator, "
                         "its pools or this machine's text sources changed since the pre-registration")
    path = Path(tasks["path"])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def all_cells(plan: dict) -> list[tuple[str, float]]:
    return runner.cells_of(plan["policies"], plan["compressions"])


def run_test(plan: dict, openai_url: str | None = None) -> int:
    """The registered steps in their order (each resumes), then the summary naming the pre-registration."""
    tasks = write_tasks(plan)
    settings, out_dir = plan["settings"], Path(plan["results"])
    for step in plan["order"]:
        runner.run(step["route"], tasks, [(policy, ratio) for policy, ratio in step["cells"]], out_dir, settings["reply_tokens"],
                   settings["answer_tokens"], Path(settings["model"]), openai_url, settings["chunk"])
    return 0 if summarise(plan)["all_chats_ran"] else 1


def summarise(plan: dict) -> dict:
    """multiturn.json of every chat run so far (a prefix of the registered ones per row), naming the plan."""
    registration = {"file": plan["file"], "commits": registration_commits(Path(plan["file"])), "chats": plan["tasks"]["num"]}
    return runner.report(Path(plan["tasks"]["path"]), Path(plan["results"]), all_cells(plan), {"preregistration": registration},
                         tuple(plan["routes"]))
