"""What a policy's answers say against the full cache's on the same chats (one route).

Per bounded row: accuracy with its 95% Wilson interval; the ratio to the full cache's accuracy with a 95%
paired bootstrap interval (chats resampled together under both caches); the retained share, of the chats
the full cache answers the share this cache still answers, with its Wilson interval; the paired difference
of accuracies with its bootstrap interval, and the counts of chats only one of the two answers.
"""

from __future__ import annotations

import random

from kvpop_eval.quality.report import wilson_interval

RESAMPLES = 5000
SEED = 0


def _percentiles(values: list[float]) -> list[float] | None:
    """The 2.5th and 97.5th percentiles (None without values)."""
    ordered = sorted(values)
    return [ordered[int(0.025 * len(ordered))], ordered[int(0.975 * len(ordered)) - 1]] if ordered else None


def paired_intervals(correct: str, full: str, seed: int = SEED) -> dict[str, list[float] | None]:
    """95% paired bootstrap intervals of accuracy(policy) / accuracy(full) (over the resamples where the full
    cache answers any chat) and of their difference, from the per-chat answers ('1'/'0' strings, one order)."""
    pairs = [(int(a), int(b)) for a, b in zip(correct, full, strict=True)]
    rng = random.Random(seed)
    ratios, differences = [], []
    for _ in range(RESAMPLES):
        sample = rng.choices(pairs, k=len(pairs))
        ours, theirs = sum(a for a, _ in sample), sum(b for _, b in sample)
        if theirs:
            ratios.append(ours / theirs)
        differences.append((ours - theirs) / len(pairs))
    return {"ratio": _percentiles(ratios), "difference": _percentiles(differences)}


def compare(row: dict, full: dict) -> dict:
    """The figures of one bounded row against the full cache's row (both with `correct_by_task`); a ratio or
    share is None when the full cache answers no chat."""
    correct, reference = row["correct_by_task"], full["correct_by_task"]
    count, answered, full_answered = len(correct), correct.count("1"), reference.count("1")
    kept = sum(a == b == "1" for a, b in zip(correct, reference))
    intervals = paired_intervals(correct, reference)
    return {
        "accuracy": answered / count,
        "accuracy_interval": list(wilson_interval(answered, count)),
        "ratio": answered / full_answered if full_answered else None,
        "ratio_interval": intervals["ratio"],
        "retained": kept / full_answered if full_answered else None,
        "retained_interval": list(wilson_interval(kept, full_answered)) if full_answered else None,
        "difference": (answered - full_answered) / count,
        "difference_interval": intervals["difference"],
        "gained": sum(a == "1" and b == "0" for a, b in zip(correct, reference)),
        "lost": sum(a == "0" and b == "1" for a, b in zip(correct, reference)),
    }
