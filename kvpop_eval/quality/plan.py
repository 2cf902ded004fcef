"""A pre-registered evaluation plan, run piece by piece: the tasks files (with their digests), the settings, the
pieces (lines x policies) and the analysis, fixed in a JSON file committed before the first test task runs.

    python -m kvpop_eval.quality.plan tasks  --plan docs/results/preregistration-diverse.json   # write + check the tasks files
    python -m kvpop_eval.quality.plan run    --plan ... --piece 3                                # one piece (resumes where it stopped)
    python -m kvpop_eval.quality.plan status --plan ...                                          # pieces done, partly done, not started
    python -m kvpop_eval.quality.plan analyse --plan ... --out-dir DIR                          # every finished task, the plan's analysis

A piece's results go to `<results>/piece-NN/` (kvpop_eval.quality.prefill_once, one line per finished task), so
a session that ends mid-piece loses at most the task it was on. `analyse` reads the pieces of each tasks file
in line order and stops at the first task not yet run: what it reports is every task up to there, never a
selection.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
from pathlib import Path

from kvpop_eval.provenance import stamp
from kvpop_eval.quality import analysis, prefill_once


def registration_commits(path: str) -> list[str]:
    """Every commit of the plan file, the registration first (its amendments after, each made before any test
    task ran: the plan says so): what the plan's results name as its pre-registration."""
    try:
        found = subprocess.run(["git", "log", "--format=%H", "--", path], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return []
    return found.stdout.split()[::-1]


def load_plan(path: Path) -> dict:
    plan = {**json.loads(Path(path).read_text()), "file": str(path)}
    for number, piece in enumerate(plan["pieces"], start=1):
        if piece["piece"] != number:
            raise ValueError(f"{path}: piece {number} is numbered {piece['piece']}")
    return plan


def check_tasks(plan: dict) -> None:
    """Every tasks file exists and has the digest the plan registered."""
    for tasks in plan["task_files"]:
        digest = hashlib.sha256(Path(tasks["path"]).read_bytes()).hexdigest()
        if digest != tasks["sha256"]:
            raise ValueError(f"{tasks['path']}: sha256 {digest}, the plan registered {tasks['sha256']}: not the registered tasks "
                             "(the readme, chat, legal and changelog sources read the installed packages and system files: "
                             "the registered files come from `make setup` and `make system-deps`; docs/QUALITY.md)")


def write_tasks(plan: dict) -> None:
    from kvpop_eval.diverse_tasks import write_tasks as write

    for tasks in plan["task_files"]:
        path = Path(tasks["path"])
        if not path.exists():
            write(path, tasks["split"], tasks["num"], tasks["context_tokens"], Path(plan["settings"]["tokenizer"]))
    check_tasks(plan)


def piece_dir(plan: dict, number: int) -> Path:
    return Path(plan["results"]) / f"piece-{number:02d}"


def done_tasks(plan: dict, number: int) -> int:
    path = piece_dir(plan, number) / "tasks.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def piece_size(piece: dict) -> int:
    first, last = prefill_once.line_range(piece["lines"])
    return last - first + 1


def run_piece(plan: dict, number: int) -> None:
    check_tasks(plan)
    piece, settings = plan["pieces"][number - 1], plan["settings"]
    prefill_once.main([
        "--model", settings["model"], "--tasks", piece["tasks"], "--lines", piece["lines"], "--policies", ",".join(piece["policies"]),
        "--compressions", ",".join(str(ratio) for ratio in settings["compressions"]), "--scoring", settings["scoring"],
        "--max-tokens", str(settings["max_tokens"]), "--sinks", str(settings["sinks"]), "--window", str(settings["window"]),
        "--prefill-chunk", str(settings["prefill_chunk"]), "--batch-size", str(settings["batch_size"]),
        "--out-dir", str(piece_dir(plan, number)),
    ])


def finished_runs(plan: dict, tasks_path: str, policies: tuple[str, ...] | None = None) -> tuple[list[Path], int]:
    """The piece folders of one tasks file, in line order, up to the first piece not finished (that one included
    with the tasks it has done), and how many tasks they hold. `policies`: only pieces that run all of them."""
    runs, count = [], 0
    for piece in plan["pieces"]:
        if piece["tasks"] != tasks_path or (policies and not set(policies) <= set(piece["policies"])):
            continue
        done = done_tasks(plan, piece["piece"])
        if done:
            runs.append(piece_dir(plan, piece["piece"]))
            count += done
        if done < piece_size(piece):
            break
    return runs, count


def write_sweep(plan: dict, group: dict, runs: list[Path], subset: Path, out_dir: Path) -> None:
    """The group's tasks as one sweep (harness.sweep's format: the full cache and the group's policies), naming the plan and the
    commit it was registered at: what `make publish-results` takes into docs/results/."""
    records = analysis.load_records(runs, subset)
    wanted = ("full", *group["policies"])
    names = [name for name in records[0]["cells"]
             if name.rpartition("@")[0] in wanted and all(name in record["cells"] for record in records)]
    cells = [prefill_once.Cell(name.rpartition("@")[0], float(name.rpartition("@")[2])) for name in names]
    summary = prefill_once.summarize(records, cells, {})
    header = stamp({"tasks": len(records), "scoring": plan["settings"]["scoring"], "tasks_file": str(subset),
                    "tasks_sha256": hashlib.sha256(subset.read_bytes()).hexdigest(), "harness": "prefill_once",
                    "plan": plan["name"], "registered_at": registration_commits(plan["file"]),
                    "pieces": [run.name for run in runs], "tasks_registered": len(Path(group["tasks"]).read_text().splitlines()),
                    "complete": True})  # the analysis of every task run so far (tasks_registered: the plan's)
    (out_dir / "sweep.json").write_text(json.dumps({**header, "results": summary}, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvpop_eval.quality.plan", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["tasks", "run", "status", "analyse"])
    parser.add_argument("--plan", type=Path, required=True)
    parser.add_argument("--piece", type=int, help="run: the piece's number")
    parser.add_argument("--out-dir", type=Path, help="analyse: where analysis.json and analysis.md go")
    args = parser.parse_args(argv)
    plan = load_plan(args.plan)
    if args.command == "tasks":
        write_tasks(plan)
        print(f"tasks files as registered: {', '.join(tasks['path'] for tasks in plan['task_files'])}")
    elif args.command == "run":
        if args.piece is None or not 1 <= args.piece <= len(plan["pieces"]):
            parser.error(f"run needs --piece 1..{len(plan['pieces'])}")
        run_piece(plan, args.piece)
    elif args.command == "status":
        for piece in plan["pieces"]:
            print(f"piece {piece['piece']:2d}  {piece['tasks']} lines {piece['lines']}: {done_tasks(plan, piece['piece'])}/{piece_size(piece)} "
                  f"tasks done  ({len(piece['policies'])} policies)")
    else:
        if args.out_dir is None:
            parser.error("analyse needs --out-dir")
        for group in plan["analysis"]["groups"]:
            runs, count = finished_runs(plan, group["tasks"], tuple(group["policies"]))
            if not count:
                continue
            lines = Path(group["tasks"]).read_text().splitlines(keepends=True)
            first = prefill_once.line_range(next(p["lines"] for p in plan["pieces"] if piece_dir(plan, p["piece"]) == runs[0]))[0]
            subset = args.out_dir / group["name"] / "tasks.jsonl"
            subset.parent.mkdir(parents=True, exist_ok=True)
            subset.write_text("".join(lines[first - 1 : first - 1 + count]))
            analysis.main(["--runs", *map(str, runs), "--tasks", str(subset), "--out-dir", str(args.out_dir / group["name"]),
                           "--detail", ",".join(group.get("detail", []))])
            write_sweep(plan, group, runs, subset, args.out_dir / group["name"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
