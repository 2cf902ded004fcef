"""The pre-registered analysis of prefill-once runs: accuracy ratio and retained share against the full cache,
with intervals, overall and per family, source, layout and held-out part.

    python -m kvpop_eval.quality.analysis --runs DIR [DIR ...] --tasks FILE.jsonl --out-dir DIR

`--runs`: prefill-once output folders (`tasks.jsonl` each) whose tasks, in order, are the lines of `--tasks`
(pieces of one plan, checked line by line by the task index and answer). For every cell (policy, compression):
  accuracy        correct / tasks, with its 95% Wilson interval
  ratio           accuracy / the full cache's accuracy, with a 95% paired bootstrap interval (the tasks resampled
                  with replacement, BOOTSTRAP resamples, seed 0; percentile interval): the headline quotes its
                  lower bound
  retained        of the tasks the full cache answers, the share this cell still answers (95% Wilson interval)
  lost in cache   of the full cache's answers this cell loses, how many lost the answer's tokens in the
                  eviction (the rest are the model's: the answer still in every cache, a different reply)
Groups: all tasks, each family, each source, each layout, held-out sources vs the others.
Writes analysis.json and analysis.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from kvpop_eval.provenance import stamp
from kvpop_eval.quality.report import wilson_interval

BOOTSTRAP = 10_000
GROUPINGS = ("family", "source", "layout", "held_out")


def load_records(runs: list[Path], tasks_file: Path) -> list[dict]:
    """The runs' task records in order, each checked against its line of the tasks file."""
    tasks = [json.loads(line) for line in tasks_file.read_text().splitlines() if line.strip()]
    records = [json.loads(line) for run in runs for line in (run / "tasks.jsonl").read_text().splitlines()]
    for record, task in zip(records, tasks):
        if record["index"] != task.get("index") or record["answer"] != task["answer"]:
            raise ValueError(f"task {record['index']} of the runs is not task {task.get('index')} of {tasks_file}")
    for record, task in zip(records, tasks):
        record.update({key: task[key] for key in ("source", "family", "layout", "held_out", "gap") if key in task})
    return records


def cell_statistics(correct: np.ndarray, full: np.ndarray, in_cache: np.ndarray | None = None, seed: int = 0) -> dict:
    """(n,) bool each: this cell's answers, the full cache's, and whether the answer survived the eviction (None:
    not known, and `lost_in_cache` is None)."""
    count = len(correct)
    accuracy, full_accuracy = correct.mean(), full.mean()
    rng = np.random.default_rng(seed)
    draws = rng.integers(0, count, size=(BOOTSTRAP, count))
    resampled_full = full[draws].mean(axis=1)
    ratios = correct[draws].mean(axis=1) / np.where(resampled_full > 0, resampled_full, np.nan)
    low, high = np.nanpercentile(ratios, [2.5, 97.5]) if full_accuracy else (float("nan"), float("nan"))
    answered = int(full.sum())
    kept = int((correct & full).sum())
    lost = full & ~correct
    return {
        "tasks": count, "correct": int(correct.sum()), "accuracy": float(accuracy),
        "accuracy_interval": list(wilson_interval(int(correct.sum()), count)),
        "ratio": float(accuracy / full_accuracy) if full_accuracy else None, "ratio_interval": [float(low), float(high)],
        "full_correct": answered, "retained": kept / answered if answered else None,
        "retained_interval": list(wilson_interval(kept, answered)) if answered else None,
        "gained": int((correct & ~full).sum()), "lost": int(lost.sum()),
        "lost_in_cache": None if in_cache is None else int((lost & ~in_cache).sum()),
    }


def analyse(records: list[dict]) -> dict:
    cells = [name for name in records[0]["cells"] if all(name in record["cells"] for record in records)]  # run on every task
    groups: dict[str, list[int]] = {"all": list(range(len(records)))}
    for key in GROUPINGS:
        for index, record in enumerate(records):
            if key in record:
                groups.setdefault(f"{key}={record[key]}", []).append(index)
    full_name = next(name for name in cells if name.startswith("full@"))
    result = {}
    for group, indices in groups.items():
        full = np.array([records[i]["cells"][full_name]["correct"] for i in indices])
        rows = {}
        for name in cells:
            correct = np.array([records[i]["cells"][name]["correct"] for i in indices])
            in_cache = np.array([records[i]["cells"][name]["in_cache"] is not False for i in indices])
            rows[name] = cell_statistics(correct, full, in_cache)
        result[group] = rows
    return result


def markdown(analysis: dict, groups: tuple[str, ...] = ("all",)) -> str:
    lines = []
    for group in groups:
        rows = analysis[group]
        lines += [f"\n**{group}** ({next(iter(rows.values()))['tasks']} tasks)\n",
                  "| policy | compression | accuracy [95% Wilson] | of full [95% paired bootstrap] | retained [95% Wilson] | "
                  "+/- vs full | lost with the answer evicted |", "|---|---|---|---|---|---|---|"]
        for name, row in rows.items():
            policy, _, ratio = name.rpartition("@")
            accuracy = f"{row['accuracy']:.3f} [{row['accuracy_interval'][0]:.2f}, {row['accuracy_interval'][1]:.2f}]"
            of_full = f"{row['ratio']:.2f} [{row['ratio_interval'][0]:.2f}, {row['ratio_interval'][1]:.2f}]" if row["ratio"] is not None else "-"
            retained = (f"{row['retained']:.2f} [{row['retained_interval'][0]:.2f}, {row['retained_interval'][1]:.2f}]"
                        if row["retained"] is not None else "-")
            moved = "" if policy == "full" else f"+{row['gained']}/-{row['lost']}"
            lines.append(f"| {policy} | {float(ratio):.0%} | {accuracy} | {of_full} | {retained} | {moved} | "
                         f"{'' if policy == 'full' else row['lost_in_cache']} |")
    return "\n".join(lines) + "\n"


def by_group_table(analysis: dict, cell: str, key: str) -> str:
    """One cell's ratio and retained share in every group of `key` (family, source, ...)."""
    lines = [f"\n`{cell}` by {key}\n", f"| {key} | tasks | full | this | of full [95% paired bootstrap] | retained |", "|---|---|---|---|---|---|"]
    full_name = next(name for name in next(iter(analysis.values())) if name.startswith("full@"))
    for group, rows in analysis.items():
        if not group.startswith(f"{key}="):
            continue
        row, full = rows[cell], rows[full_name]
        ratio = f"{row['ratio']:.2f} [{row['ratio_interval'][0]:.2f}, {row['ratio_interval'][1]:.2f}]" if row["ratio"] is not None else "-"
        retained = f"{row['retained']:.2f}" if row["retained"] is not None else "-"
        lines.append(f"| {group.partition('=')[2]} | {row['tasks']} | {full['correct']} | {row['correct']} | {ratio} | {retained} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvpop_eval.quality.analysis", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=Path, nargs="+", required=True)
    parser.add_argument("--tasks", type=Path, required=True)
    parser.add_argument("--out-dir", type=Path, required=True)
    parser.add_argument("--detail", default="", help="cells to break down by every grouping, comma-separated (e.g. kvpop:mlstm@0.88)")
    args = parser.parse_args(argv)
    records = load_records(args.runs, args.tasks)
    analysis = analyse(records)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    header = stamp({"tasks_file": str(args.tasks), "tasks": len(records), "runs": [str(run) for run in args.runs],
                    "bootstrap": BOOTSTRAP})
    (args.out_dir / "analysis.json").write_text(json.dumps({**header, "groups": analysis}, indent=2) + "\n")
    text = markdown(analysis, tuple(group for group in ("all", "held_out=True", "held_out=False") if group in analysis))
    for cell in filter(None, args.detail.split(",")):
        text += "".join(by_group_table(analysis, cell, key) for key in GROUPINGS)
    (args.out_dir / "analysis.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
