"""Session 23 diagnostic (validation split only): what fills kvpop's long-range slots at 94% on multi-key tasks?

    python docs/quality/real/experiments/spans/kept_lines.py --scores build/exp-eval/span-rules-v2/val-2048-pk96-w32.npz

For every multi-key task, the shipped ranking (line contrast over the scores paired at the 32-token window,
`span_rules.py`'s `linectr@384`) picks its long-range tokens at the engine's 94% budget; each kept token is
counted by the kind of line it sits on: a needle line, the task's instruction line ("... hidden in the text below ..."), a blank
line, or haystack text. Prints the totals and how often the asked needle line is kept whole.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections import Counter
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import span_rules  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--scores", type=Path, required=True)
    parser.add_argument("--compression", type=float, default=0.94)
    parser.add_argument("--window", type=int, default=32)
    parser.add_argument("--rule", default="linectr@384")
    args = parser.parse_args()
    span_rules.WINDOW = args.window
    tokenizer = AutoTokenizer.from_pretrained(span_rules.MODEL_DIR)
    data = np.load(args.scores)
    kinds, tasks, asked_whole, slots = Counter(), 0, 0, 0
    for number in np.flatnonzero(data["families"] == "multikey"):
        ids, prompt, score, spans, candidates = span_rules.task_views(tokenizer, data, number)
        budget = math.ceil((1 - args.compression) * (len(ids) + span_rules.MAX_TOKENS))
        long_range = budget - span_rules.SINKS - args.window
        kept = span_rules.kept_set(span_rules.rule_priority(args.rule, score, spans), candidates, long_range, prompt)
        needles = span_rules.needle_lines(tokenizer, ids, 0)
        asked = span_rules.needle_lines(tokenizer, ids, 0, containing=str(data["answers"][number]))
        line = spans["line48"]
        for position in sorted(kept & set(candidates.tolist())):
            text = tokenizer.decode([ids[p] for p in np.flatnonzero(line == line[position])])
            kind = ("needle" if position in needles else "instruction" if "hidden in the text below" in text
                    else "blank" if not text.strip() else "haystack")
            kinds[kind] += 1
        tasks, asked_whole, slots = tasks + 1, asked_whole + (asked <= kept), slots + long_range
    print(f"{tasks} multi-key tasks at {args.compression:.0%}: {slots / tasks:.1f} long-range slots a task; asked line kept whole in {asked_whole}")
    for kind, count in kinds.most_common():
        print(f"  {kind:12s} {count:5d} tokens  ({count / tasks:.1f} a task)")


if __name__ == "__main__":
    main()
