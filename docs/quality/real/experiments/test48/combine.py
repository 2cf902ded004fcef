"""Session 23: test-split rows on 48 tasks instead of 12 (2,048 tokens; at 4,096 the 94% cell).

    python docs/quality/real/experiments/test48/combine.py --committed docs/quality/real/2048/sweep.json \
        --new docs/quality/real/2048/session-23-test48/sweep.json --kvpress docs/quality/real/2048/session-23-test48/kvpress.json \
        --out docs/quality/real/2048/session-23-test48/combined.md [--new more/sweep.json ...] [--context-tokens 4096]

`benchmarks.english_tasks write --split test --num 48` writes the committed 12-task file's lines first, byte
for byte (sha256 of its first 12 lines 493a976d..., the table's file), then 36 more test tasks (same seeds
scheme, none shared with validation). The 36 were run once for each row (greedy decoding: the first 12 would
answer as committed, so their per-task answers are taken from `--committed`). Each row here is the 12
committed answers followed by the 36 new ones, with its 95% Wilson interval, its fraction of the full cache
its paired counts against the full cache and a 95% paired bootstrap interval of that fraction. Rows that exist only in the 12-task table are left out.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[5]))

from kvpop.eval import paired_counts, wilson_interval  # noqa: E402

def ratio_interval(correct: str, full: str, draws: int = 10_000, seed: int = 0) -> tuple[float, float]:
    """95% paired bootstrap interval of (right here) / (right with the full cache): tasks resampled together."""
    row, reference = (np.array([c == "1" for c in text]) for text in (correct, full))
    picks = np.random.default_rng(seed).integers(0, len(row), size=(draws, len(row)))
    ratios = row[picks].sum(axis=1) / np.maximum(reference[picks].sum(axis=1), 1)
    return float(np.quantile(ratios, 0.025)), float(np.quantile(ratios, 0.975))


def rows_of(results: list[dict]) -> dict[tuple[str, float], str]:
    """(policy, compression) -> correct_by_task (the full cache at 0)."""
    return {(row["policy"], row["compression"]): row["correct_by_task"] for row in results
            if row.get("correct_by_task") is not None and (row["policy"] == "full" or row["compression"] > 0)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--committed", type=Path, required=True, help="the 12-task sweep.json (merged table)")
    parser.add_argument("--new", type=Path, nargs="+", required=True, help="kvpop.eval sweep.json files of the 36 new tasks")
    parser.add_argument("--kvpress", type=Path, nargs="*", default=[], help="kvpress_compare run outputs on the 36 new tasks")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--context-tokens", type=int, default=2048, help="the tasks' context length, for the heading")
    args = parser.parse_args()
    committed = rows_of(json.loads(args.committed.read_text())["results"])
    new: dict[tuple[str, float], str] = {}
    for path in [*args.new, *args.kvpress]:
        new |= rows_of(json.loads(path.read_text())["results"])
    full = committed[("full", 0.0)] + new[("full", 0.0)]
    lines = [f"{args.context_tokens:,} tokens, {len(full)} test tasks: the committed 12 (`{args.committed}`) + 36 new, run once. "
             f"Full cache: {full.count('1')} / {len(full)}.", ""]
    summary = {}
    for compression in sorted({c for _, c in new if c > 0}):
        lines += [f"**{compression:.0%} compression**", "",
                  "| policy | right | accuracy [95% Wilson] | of full [95% paired bootstrap] | paired vs full (+/-) | first 12 | new 36 |",
                  "|---|---|---|---|---|---|---|"]
        policies = sorted({p for p, c in new if c == compression and (p, c) in committed},
                          key=lambda p: (not p.startswith("kvpop:"), p))
        for policy in policies:
            correct = committed[(policy, compression)] + new[(policy, compression)]
            right, count = correct.count("1"), len(correct)
            low, high = wilson_interval(right, count)
            wins, losses = paired_counts(correct, full)
            ratio = right / max(full.count("1"), 1)
            ratio_low, ratio_high = ratio_interval(correct, full)
            summary[f"{policy} {compression}"] = {"right": right, "tasks": count, "accuracy": right / count,
                                                  "wilson95": [low, high], "of_full": ratio, "of_full_bootstrap95": [ratio_low, ratio_high],
                                                  "paired_vs_full": [wins, losses], "correct_by_task": correct}
            lines.append(f"| {policy} | {right} / {count} | {right / count:.3f} [{low:.2f}, {high:.2f}] | {ratio:.2f} [{ratio_low:.2f}, {ratio_high:.2f}] | "
                         f"+{wins}/-{losses} | {committed[(policy, compression)].count('1')} | "
                         f"{new[(policy, compression)].count('1')} |")
        lines.append("")
    summary["full"] = {"right": full.count("1"), "tasks": len(full), "correct_by_task": full}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    args.out.with_suffix(".json").write_text(json.dumps(summary, indent=1) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
