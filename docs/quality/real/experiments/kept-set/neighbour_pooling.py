"""Session 16 probe (validation split only; nothing ships): pool the shared learned scores over neighbouring
tokens before they are ranked, so that the words around a kept token stay with it.

    python docs/quality/real/experiments/kept-set/neighbour_pooling.py RADIUS MODE --model model_repository/kvpop_engine/1 \
        --tasks build/real-tasks/val-2048-pk24.jsonl --sweep --scoring contains --max-tokens 32 --window 64 \
        --policies kvpop:mlstm --compressions 0.75,0.88 --skip-full --out-dir build/exp-eval/pool
    DELTA=1 python ... 1 fwd ...

MODE `max`: a token's score is the max over its RADIUS neighbours on each side (SnapKV's pooling); `avg`
the mean; `fwd`: a token is worth max(its own score, the next RADIUS tokens' scores minus DELTA), i.e. the
words that lead up to a strong token (the " is" and the space before a pass key's digits) are kept with it.
Pooling is over the tokens leaving in one append (a prefill chunk); across appends only the previous
append's last raw scores are carried (backward neighbours), and one-token decode steps are not pooled.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[5]))

from kvpop import eval as evaluation  # noqa: E402
from kvpop.scorer import runtime  # noqa: E402

RADIUS, MODE = int(sys.argv[1]), sys.argv[2]
DELTA = float(os.environ.get("DELTA", "0"))
original_score = runtime.LearnedScorer.score
carried: dict[int, np.ndarray] = {}  # id(scorer state) -> the last RADIUS raw scores, position order


def pooled(raw: np.ndarray, before: np.ndarray) -> np.ndarray:
    """(M,) raw scores of consecutive positions -> pooled, with `before` the raw scores just before them."""
    scores = np.concatenate([before, raw])
    out = np.empty(len(raw), np.float32)
    for row in range(len(raw)):
        at = row + len(before)
        low, high = max(0, at - RADIUS), min(len(scores), at + RADIUS + 1)
        if MODE == "fwd":
            out[row] = max(scores[at], scores[at + 1 : high].max() - DELTA) if high > at + 1 else scores[at]
        else:
            out[row] = scores[low:high].max() if MODE == "max" else scores[low:high].mean()
    return out


def pooled_score(self, cache, state, leaving):
    scores = np.asarray(original_score(self, cache, state, leaving), np.float32)  # (L, Hkv, M), equal over caches
    positions = leaving.positions[0, 0]
    order = np.argsort(positions)
    raw = scores[0, 0, order]
    result = pooled(raw, carried.get(id(state), np.zeros(0, np.float32)))
    carried[id(state)] = raw[-RADIUS:] if RADIUS else np.zeros(0, np.float32)
    # every cache holds the leaving tokens in its own slot order: look each one up by position
    return result[np.searchsorted(positions[order], leaving.positions)]


if __name__ == "__main__":
    runtime.LearnedScorer.score = pooled_score
    evaluation.main(sys.argv[3:])
