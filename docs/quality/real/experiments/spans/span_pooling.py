"""Session 18 probe (validation split only): rank whole spans (lines or sentences) by their best learned score.

    python docs/quality/real/experiments/spans/span_pooling.py line --model model_repository/kvpop_engine/1 \
        --tasks build/real-tasks/val-2048-pk24.jsonl --sweep --scoring contains --max-tokens 32 --window 64 \
        --policies kvpop:mlstm --compressions 0.75,0.88 --skip-full --out-dir build/exp-eval/span-line
    MAX_SPAN=24 python ... sentence ...          # spans cut at 24 tokens instead of 48
    SHOW=1 python ... sentence --model ... --tasks ... --policy kvpop --scorer mlstm --compression 0.75 \
        --scoring contains --max-tokens 32 --window 64 --out FILE   # kept-set/needles_kept.py's view of the kept tokens

Session 19: `POOL=mean HOLD=0 ... line` ranks a token by the mean score of every scored token of its line
(evicted or not) with no hold, the rule that ships (kvpop/policies/text_spans.py); `SHOW=replay` runs
kept-set/replay_kept_set.py under the patch instead of needles_kept.py.

Session 16 found the learned scorer keeps a pass key's digits and drops the space before them, and the
kept-set ceilings (experiments/ceilings/) that every needle line kept whole answers as well as the full
cache. Here, at every eviction, each unprotected candidate's priority is the best score among the held
candidates of its span (plus a small share of its own, so a span that does not fit keeps its best tokens), and the part of the
span still entering the window is held until the whole span has been scored: a span is kept or dropped
together, as ChunkKV / SentenceKV do. Spans end after a token holding a newline (`line`), or also after one
ending a sentence with . ? ! (`sentence`), and after MAX_SPAN tokens at most. Protected tokens (sinks, window)
have no score yet and do not lift their span. Generated tokens are spans of their own. Decode steps take
the one-sequence path (the vectorised decode batch ranks by raw scores).
"""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[5]))

from transformers import AutoTokenizer  # noqa: E402

from kvpop import engine as engine_module  # noqa: E402
from kvpop import eval as evaluation  # noqa: E402
from kvpop.policies import kvpop as kvpop_policy  # noqa: E402

MODE = sys.argv[1]
OWN_SHARE = 1e-3
POOL = os.environ.get("POOL", "max")  # max: the best held score of the span; mean: the mean of every scored token of it
HOLD = os.environ.get("HOLD", "1") == "1"  # hold the span still entering the window until it is scored whole
MAX_SPAN = int(os.environ.get("MAX_SPAN", "48"))  # longer spans (paragraph lines) are cut into pieces of this many tokens
PENDING = 1e6  # above every score, below the protected sinks and window
tokenizer = AutoTokenizer.from_pretrained("models/smollm2-135m-instruct")
span_of_cache: dict[int, np.ndarray] = {}  # id(cache) -> (prompt length,) span index of each position
scores_of_cache: dict[int, np.ndarray] = {}  # id(cache) -> (prompt length,) each scored position's (shared) score, NaN before
original_new_sequence = engine_module.Engine._new_sequence


def span_ids(ids: list[int]) -> np.ndarray:
    spans, span, length = [], 0, 0
    for token in ids:
        spans.append(span)
        length += 1
        text = tokenizer.decode([token])
        if "\n" in text or (MODE == "sentence" and text.rstrip().endswith((".", "?", "!"))) or length == MAX_SPAN:
            span, length = span + 1, 0
    return np.array(spans, np.int64)


def new_sequence(self, request):
    sequence = original_new_sequence(self, request)
    span_of_cache[id(sequence.cache)] = span_ids(request.prompt_ids)
    scores_of_cache.pop(id(sequence.cache), None)
    return sequence


def span_score(self, cache, candidates) -> np.ndarray:
    score = candidates.statistics[kvpop_policy.SCORE]  # (L, Hkv, N)
    positions = candidates.positions
    spans_of_prompt = span_of_cache[id(cache)]
    prompt_length = len(spans_of_prompt)
    valid = positions >= 0
    span = np.where(valid & (positions < prompt_length), spans_of_prompt[np.clip(positions, 0, prompt_length - 1)],
                    spans_of_prompt[-1] + 1 + np.maximum(positions, 0))  # generated tokens: a span each
    sinks, window = self.protected_counts(candidates.capacity)
    scored = valid & (positions >= sinks) & (positions < candidates.tokens_seen - window)
    layers, heads, _ = score.shape
    _, dense = np.unique(span, return_inverse=True)  # spans renumbered 0..S-1
    dense = dense.reshape(span.shape)
    count = int(dense.max()) + 1
    flat = (np.arange(layers * heads).reshape(layers, heads, 1) * count + dense).ravel()
    if POOL == "mean":  # every cache ranks the same positions (shared ranking): one mean per span
        recorded = scores_of_cache.setdefault(id(cache), np.full(prompt_length, np.nan, np.float32))
        in_prompt = scored & (positions < prompt_length)
        recorded[positions[in_prompt]] = score[in_prompt]
        known = ~np.isnan(recorded)
        sums = np.bincount(spans_of_prompt[known], weights=recorded[known], minlength=spans_of_prompt[-1] + 1)
        counts = np.bincount(spans_of_prompt[known], minlength=spans_of_prompt[-1] + 1)
        mean = sums / np.maximum(counts, 1)
        pooled = np.where(positions < prompt_length, mean[spans_of_prompt[np.clip(positions, 0, prompt_length - 1)]], score)
    else:
        best = np.full(layers * heads * count, -np.inf, np.float32)
        np.maximum.at(best, flat[scored.ravel()], score.ravel()[scored.ravel()])
        pooled = best[flat].reshape(score.shape)
    # The span still entering the window is judged once its last token has left: held until then.
    entering = candidates.tokens_seen - window
    if HOLD and 0 <= entering < prompt_length:
        pooled = np.where(span == spans_of_prompt[entering], PENDING, pooled)
    return np.where(scored, pooled + OWN_SHARE * score, score)


if __name__ == "__main__":
    engine_module.Engine._new_sequence = new_sequence
    kvpop_policy.KVpopPolicy.score = span_score
    kvpop_policy.KVpopPolicy.decodes_in_batch = lambda self, cache: False  # every eviction ranks through span_score
    if os.environ.get("SHOW"):  # SHOW=1: needles_kept.py's view; SHOW=replay: replay_kept_set.py
        sys.argv = [sys.argv[0], *sys.argv[2:]]
        script = "replay_kept_set.py" if os.environ["SHOW"] == "replay" else "needles_kept.py"
        runpy.run_path(str(Path(__file__).resolve().parents[1] / "kept-set" / script), run_name="__main__")
    else:
        evaluation.main(sys.argv[2:])
