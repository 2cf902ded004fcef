"""Validation-split probes behind docs/quality/real/README.md "What keeping the needle is worth".

    python docs/quality/real/experiments/needle_oracle.py oracle 12 --model model_repository/kvpop_engine/1 \
        --tasks build/real-tasks/val-2048-pk8.jsonl --sweep --scoring contains --max-tokens 32 --window 64 \
        --policies kvpop:mlstm --compressions 0.75,0.88,0.94 --out-dir build/oracle12
    python docs/quality/real/experiments/needle_oracle.py share-layer ... (same arguments)

Runs `python -m kvpop.eval` with the shipped SmolLM2 mLSTM scorer patched, an experiment rather than a
policy (nothing here ships):
  * `oracle N`: every token of the answer's digits and the N tokens before them (the needle, found by
    the answer's token ids in the prompt) gets an infinite score, so it is never evicted; everything
    else is ranked by the learned scorer as usual. An upper bound for a scorer that recognised needles.
  * `share-layer` / `share-model`: the learned scores averaged over a layer's KV heads (or all heads),
    so those heads keep the same tokens; `share-none` runs the scorer unpatched. Since session 15,
    `share-model` is what serving does for a scorer exported with `"shared_ranking": true`
    (kvpop.scorer.runtime.ScorerRuntime._ranked), so on the shipped scorers it changes nothing.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Callable, Iterable

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[4]))

from kvpop import engine as engine_module  # noqa: E402
from kvpop.scorer import runtime  # noqa: E402

original_score, original_batch = runtime.LearnedScorer.score, runtime.LearnedScorer.score_decode_batch


def needle_span(tokenizer, ids: list[int], target: str, tokens_before: int) -> set[int]:
    """Positions in `ids` of every occurrence of `target` (tokenized alone and after a space) and the
    `tokens_before` tokens before each."""
    span: set[int] = set()
    for text in (target, " " + target):
        needle = tokenizer(text, add_special_tokens=False)["input_ids"]
        for start in range(len(ids) - len(needle) + 1):
            if ids[start : start + len(needle)] == needle:
                span.update(range(max(0, start - tokens_before), start + len(needle)))
    return span


def protect_needles(tokenizer, targets_for: Callable[[list[int]], Iterable[str]], tokens_before: int) -> None:
    """Patch the engine so that, in every sequence, each occurrence of a target string (tokenized alone and
    after a space) and the `tokens_before` tokens before it get an infinite learned score (never evicted).
    `targets_for(prompt_ids)` names the strings to protect in that prompt."""
    protected: dict[int, set[int]] = {}  # id(cache) -> prompt positions never evicted
    new_sequence = engine_module.Engine._new_sequence

    def patched_new_sequence(self, request):
        sequence = new_sequence(self, request)
        ids = request.prompt_ids
        protected[id(sequence.cache)] = set().union(*(needle_span(tokenizer, ids, t, tokens_before) for t in targets_for(ids)))
        return sequence

    def patched_score(self, cache, state, leaving):  # (L, Hkv, M): prompt tokens leave here, not in decode
        scores = np.array(original_score(self, cache, state, leaving), dtype=np.float32)
        span = protected.get(id(cache))
        if span:
            scores[np.isin(leaving.positions, list(span))] = 1e9
        return scores

    engine_module.Engine._new_sequence = patched_new_sequence
    runtime.LearnedScorer.score = patched_score


def share_scores(axes_single: tuple[int, ...], axes_batch: tuple[int, ...]) -> None:
    def share(scores, axes):
        scores = np.asarray(scores)
        return np.broadcast_to(scores.mean(axis=axes, keepdims=True), scores.shape).copy()

    runtime.LearnedScorer.score = lambda self, *a: share(original_score(self, *a), axes_single)  # (L, Hkv, M)
    runtime.LearnedScorer.score_decode_batch = lambda self, *a: share(original_batch(self, *a), axes_batch)  # (B, L, Hkv)


def main() -> int:
    mode = sys.argv.pop(1)
    if mode == "oracle":
        from transformers import AutoTokenizer

        tokens_before = int(sys.argv.pop(1))
        model_dir = Path(sys.argv[sys.argv.index("--model") + 1])
        answers = [json.loads(line)["answer"] for line in open(sys.argv[sys.argv.index("--tasks") + 1])]
        # only the asked answer's digits occur in its prompt
        protect_needles(AutoTokenizer.from_pretrained(model_dir / "tokenizer"), lambda ids: answers, tokens_before)
    elif mode == "share-layer":
        share_scores((1,), (2,))
    elif mode == "share-model":
        share_scores((0, 1), (1, 2))
    elif mode != "share-none":
        raise SystemExit(f"unknown mode {mode!r}")

    from kvpop import eval as evaluation

    return evaluation.main()


if __name__ == "__main__":
    sys.exit(main())
