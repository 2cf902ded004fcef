"""Session 21: move a committed sweep onto the reshuffled task file without rerunning its unchanged tasks.

    python docs/quality/real/experiments/reshuffle/splice_rows.py --old-dir docs/quality/real/2048 \
        --old-tasks build/real-tasks/test-2048-pk12.v1.jsonl --new-tasks build/real-tasks/test-2048-pk12.jsonl \
        --runs build/exp-eval/reshuffle/test-2048-mk6 --kvpress build/exp-eval/reshuffle/kvpress-2048-mk6.json \
        [--whole DIR ...] [--drop kvpop:mlp] --out-dir docs/quality/real/2048

Until session 21 the generator put the asked fact first among a multikey task's six (benchmarks/english_tasks.py
now shuffles them). The pass-key tasks of the test files are byte-identical before and after (test_english_tasks
checks it); only the multikey tasks changed. A row of the new table takes, task by task, the answer it gave on an
unchanged task from the committed row (greedy decoding: the same prompt gives the same answer under the same code)
and the answer on a changed task from `--runs` (sweeps of the changed tasks alone, in file order) or, for kvpress,
from `--kvpress`. Rows measured on the whole new file (`--whole`) replace spliced ones. Every row says which of its
answers were carried over; the runtime columns of a spliced row are those of the run on the changed tasks.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[5]))

from kvpop.eval import markdown_table, plot_sweep  # noqa: E402


def sha256(lines: list[str]) -> str:
    return hashlib.sha256("".join(line + "\n" for line in lines).encode()).hexdigest()


def splice_bits(old_bits: str, new_bits: str, changed: list[int], count: int) -> str:
    """Task-by-task answers on the new file: the old row's on unchanged tasks, the new run's on changed ones."""
    if len(old_bits) != count or len(new_bits) != len(changed):
        raise ValueError(f"rows of {len(old_bits)} / {len(new_bits)} tasks, expected {count} / {len(changed)}")
    bits = list(old_bits)
    for offset, index in enumerate(changed):
        bits[index] = new_bits[offset]
    return "".join(bits)


def spliced_row(old: dict, new: dict, changed: list[int], count: int, carried_from: str) -> dict:
    bits = splice_bits(old["correct_by_task"], new["correct_by_task"], changed, count)
    return {**new, "accuracy": bits.count("1") / count, "tasks": count, "correct_by_task": bits,
            "carried_over": f"{count - len(changed)} unchanged tasks' answers from the run on {carried_from[:8]}; "
                            f"runtime columns from the {len(changed)} changed tasks"}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--old-dir", type=Path, required=True, help="committed sweep folder (sweep.json, kvpress.json)")
    parser.add_argument("--old-tasks", type=Path, required=True)
    parser.add_argument("--new-tasks", type=Path, required=True)
    parser.add_argument("--runs", type=Path, nargs="+", required=True, help="sweeps of the changed tasks alone")
    parser.add_argument("--kvpress", type=Path, help="kvpress_compare run on the changed tasks alone")
    parser.add_argument("--whole", type=Path, nargs="*", default=[], help="sweeps (--skip-full) of the whole new file")
    parser.add_argument("--drop", default="", help="policies not rerun on the changed tasks: left out of the new table")
    parser.add_argument("--out-dir", type=Path, required=True)
    args = parser.parse_args()

    old_lines, new_lines = args.old_tasks.read_text().splitlines(), args.new_tasks.read_text().splitlines()
    count = len(new_lines)
    assert len(old_lines) == count, "the files must hold the same number of tasks"
    changed = [index for index in range(count) if old_lines[index] != new_lines[index]]
    changed_sha = sha256([new_lines[index] for index in changed])
    old_sha, new_sha = sha256(old_lines), sha256(new_lines)
    sweep = json.loads((args.old_dir / "sweep.json").read_text())
    assert sweep["tasks_sha256"] == old_sha, f"{args.old_dir} was not run on {args.old_tasks}"

    new_rows: dict[tuple[str, float], dict] = {}
    for folder in args.runs:
        run = json.loads((folder / "sweep.json").read_text())
        assert run["tasks_sha256"] == changed_sha, f"{folder} was not run on exactly the changed tasks"
        new_rows.update({(row["policy"], row["compression"]): row for row in run["results"]})
    whole_rows: dict[tuple[str, float], dict] = {}
    for folder in args.whole:
        run = json.loads((folder / "sweep.json").read_text())
        assert run["tasks_sha256"] == new_sha, f"{folder} was not run on {args.new_tasks}"
        whole_rows.update({(row["policy"], row["compression"]): row for row in run["results"]})

    dropped = [policy for policy in args.drop.split(",") if policy]
    engine_rows = [row for row in sweep["results"] if not row["policy"].startswith("kvpress:") and row["policy"] not in dropped]
    full = spliced_row(next(row for row in engine_rows if row["policy"] == "full"), new_rows[("full", 0.0)], changed, count, old_sha)
    summary, missing = [full], []
    for row in engine_rows:
        key = (row["policy"], row["compression"])
        if row["policy"] == "full":
            continue
        if row["compression"] == 0.0:
            summary.append({**full, "policy": row["policy"], "note": "no eviction at 0%: the full cache"})
        elif key in whole_rows:
            summary.append(whole_rows[key])
        elif key in new_rows:
            summary.append(spliced_row(row, new_rows[key], changed, count, old_sha))
        else:
            missing.append(key)
    if missing:
        raise SystemExit(f"no run of the changed tasks for {missing}")
    header = {"tasks": count, "scoring": sweep["scoring"], "tasks_file": str(args.new_tasks), "tasks_sha256": new_sha,
              "spliced_from": {"sweep": str(args.old_dir), "tasks_sha256": old_sha, "changed_tasks": changed,
                               "changed_runs": [str(folder) for folder in args.runs], "whole_runs": [str(f) for f in args.whole],
                               "dropped_policies": dropped}}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "sweep.json").write_text(json.dumps({**header, "results": summary}, indent=2) + "\n")
    compressions = tuple(sorted({row["compression"] for row in summary}))
    (args.out_dir / "sweep.md").write_text(markdown_table(summary, compressions))
    plot_sweep(summary, args.out_dir / "accuracy_vs_compression.png")
    print(f"{args.out_dir}/sweep.json: {len(summary)} rows on {args.new_tasks} ({new_sha[:8]}), tasks {changed} rerun")

    if args.kvpress:
        from benchmarks.kvpress_compare import merge

        old_peer = json.loads((args.old_dir / "kvpress.json").read_text())
        peer = json.loads(args.kvpress.read_text())
        assert old_peer["tasks_sha256"] == old_sha and peer["tasks_sha256"] == changed_sha
        hf_rows = list(old_peer["full_hf_rows"])
        for offset, index in enumerate(changed):
            hf_rows[index] = {**peer["full_hf_rows"][offset], "index": index}
        full_hf = sum(row["correct"] for row in hf_rows) / count
        peer_rows = {(row["policy"], row["compression"]): row for row in peer["results"]}
        results = []
        for row in old_peer["results"]:
            new = peer_rows[(row["policy"], row["compression"])]
            results.append({**new, "accuracy": full_hf, "tasks": count} if row["compression"] == 0.0
                           else spliced_row(row, new, changed, count, old_sha))
        spliced = {**peer, "tasks_file": str(args.new_tasks), "tasks_sha256": new_sha, "tasks": count, "results": results,
                   "full_hf_rows": hf_rows, "full_accuracy_hf": full_hf,
                   "spliced_from": {"kvpress": str(args.old_dir / "kvpress.json"), "tasks_sha256": old_sha,
                                    "changed_tasks": changed, "changed_run": str(args.kvpress)}}
        (args.out_dir / "kvpress.json").write_text(json.dumps(spliced, indent=2) + "\n")
        merge(args.out_dir / "kvpress.json", args.out_dir)
        print(f"{args.out_dir}/kvpress.json: {len(results)} kvpress rows spliced and merged")


if __name__ == "__main__":
    main()
