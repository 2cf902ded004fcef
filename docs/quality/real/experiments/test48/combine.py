"""Session 23: the 94% column at 2,048 tokens on 48 test tasks instead of 12.

    python docs/quality/real/experiments/test48/combine.py --committed docs/quality/real/2048/sweep.json \
        --new docs/quality/real/2048/session-23-test48/sweep.json --kvpress docs/quality/real/2048/session-23-test48/kvpress.json \
        --out docs/quality/real/2048/session-23-test48/combined.md

`benchmarks.english_tasks write --split test --num 48` writes the committed 12-task file's lines first, byte
for byte (sha256 of its first 12 lines 493a976d..., the table's file), then 36 more test tasks (same seeds
scheme, none shared with validation). The 36 were run once for every policy at 94% (greedy decoding: the
first 12 would answer as committed, so their per-task answers are taken from `--committed`). Each row here is
the 12 committed answers followed by the 36 new ones, with its 95% Wilson interval, its fraction of the full
cache and its paired counts against the full cache.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[5]))

from kvpop.eval import paired_counts, wilson_interval  # noqa: E402

COMPRESSION = 0.94


def rows_at(results: list[dict], compression: float) -> dict[str, str]:
    """policy -> correct_by_task of the rows at `compression` (the full cache at 0)."""
    out = {}
    for row in results:
        if row.get("correct_by_task") is None:
            continue
        if row["policy"] == "full" and row["compression"] == 0.0:
            out["full"] = row["correct_by_task"]
        elif row["compression"] == compression:
            out[row["policy"]] = row["correct_by_task"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--committed", type=Path, required=True, help="the 12-task sweep.json (merged table)")
    parser.add_argument("--new", type=Path, required=True, help="kvpop.eval sweep.json of the 36 new tasks")
    parser.add_argument("--kvpress", type=Path, help="kvpress_compare run output on the 36 new tasks")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    committed = rows_at(json.loads(args.committed.read_text())["results"], COMPRESSION)
    new = rows_at(json.loads(args.new.read_text())["results"], COMPRESSION)
    if args.kvpress:
        new |= rows_at(json.loads(args.kvpress.read_text())["results"], COMPRESSION)
    full = committed["full"] + new["full"]
    lines = [
        f"94% compression at 2,048 tokens on {len(full)} test tasks: the committed 12 (`2048/sweep.json`) + 36 new, run once.",
        "",
        "| policy | right | accuracy [95% Wilson] | of full | paired vs full (+/-) | first 12 | new 36 |",
        "|---|---|---|---|---|---|---|",
    ]
    summary = {}
    for policy in ["full", *sorted(set(new) - {"full"}, key=lambda p: (not p.startswith("kvpop:"), p))]:
        if policy not in committed:
            continue
        correct = committed[policy] + new[policy]
        right, count = correct.count("1"), len(correct)
        low, high = wilson_interval(right, count)
        wins, losses = paired_counts(correct, full)
        ratio = right / max(full.count("1"), 1)
        summary[policy] = {"right": right, "tasks": count, "accuracy": right / count, "wilson95": [low, high],
                           "of_full": ratio, "paired_vs_full": [wins, losses], "correct_by_task": correct}
        lines.append(f"| {policy} | {right} / {count} | {right / count:.3f} [{low:.2f}, {high:.2f}] | {ratio:.2f} | "
                     f"+{wins}/-{losses} | {committed[policy].count('1')} | {new[policy].count('1')} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    args.out.with_suffix(".json").write_text(json.dumps(summary, indent=1) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
