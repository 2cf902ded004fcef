"""Query-aware selection: the question picks a share of the long-range slots when a prompt enters whole.

With whole-prompt prefill the question is in the prompt when its one eviction happens. As SnapKV
(Li et al., 2024) and kvpress's query-aware presses do, the attention of the prompt's last W queries
(the question, the end of the user turn, the assistant header) says which earlier tokens the answer
will read. The learned score keeps what is worth keeping for any question (a later turn's, a long
answer's); the query attention finds what THIS question asks for, wherever it sits, inside running
text too. KVpop keeps both: the `share` of the long-range slots whose tokens the question attends to
most get `QUERY_BONUS` on their score (the largest value over each token's span, so a fact is kept
whole); the learned ranking fills the rest and keeps deciding every later eviction among the unpicked
tokens. The next prompt that enters whole (a session's next turn) takes the old picks back and picks again.

Whose attention counts: summed over every head, the question's attention goes mostly to the first
paragraphs and to frequent words. A few heads, the base model's retrieval heads (found once per model on
planted facts: kvpop_train.scorer.retrieval_heads), attend to the passage the question is about; when the
model ships them, their attention (each head's as a share of its largest value, summed) makes one pick
for every cache, so the heads that copy the answer later find the whole fact too. Without them each KV
head picks for itself from its own attention measured against its surroundings (SnapKV's per-head pick).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np


if TYPE_CHECKING:
    from kvpop.policies.kvpop.text_spans import TextSpans

# The service default where the learned scorer's model ships retrieval heads (KVpopPolicy.query_window None):
# the question's last WINDOW tokens pick, and prompt tokens are ranked by sentence (facts inside running text),
# as chosen on the prose families' validation split (docs/QUALITY.md).
WINDOW = 32
SPAN_POOLING = "sentence_contrast"

# Added to the score of a token the prompt's question picked: far above any learned score, so those tokens
# outrank the rest until the next question re-picks.
QUERY_BONUS = np.float32(1e4)
OWN_SHARE = 1e-3  # of a token's own attention, added to its pooled one to break ties
CONTRAST_WIDTH = 384  # a token's attention counts relative to the mean over this many positions around it
NEIGHBOURS = 3  # without spans, a token takes the largest attention within this many positions (SnapKV's pooling)


def query_bonus(score: np.ndarray) -> np.ndarray:
    """The part of `score` that is a question's bonus (QUERY_BONUS or 0, elementwise)."""
    return np.where(score >= QUERY_BONUS / 2, QUERY_BONUS, np.float32(0)).astype(np.float32)


def attention_received(query_attention: np.ndarray) -> np.ndarray:
    """(L, Hkv, G, W, C + T) -> (L, Hkv, C + T): what the window's queries of each KV head's group put on
    each old slot and new token."""
    return query_attention.sum(axis=(2, 3), dtype=np.float32)


def local_mean(values: np.ndarray, half: int) -> np.ndarray:
    """(..., N) -> (..., N): the mean of `values` over positions [n - half, n + half] (cut at the ends)."""
    total = np.concatenate([np.zeros(values.shape[:-1] + (1,), np.float64), np.cumsum(values, axis=-1, dtype=np.float64)], axis=-1)
    index = np.arange(values.shape[-1])
    low, high = np.maximum(index - half, 0), np.minimum(index + half + 1, values.shape[-1])
    return ((total[..., high] - total[..., low]) / (high - low)).astype(np.float32)


def by_position(values: np.ndarray, positions: np.ndarray, length: int) -> np.ndarray:
    """(L, Hkv, N) values of the tokens at `positions` (L, Hkv, N), -1 empty -> (L, Hkv, length) by
    position, 0 where a cache holds no token."""
    dense = np.zeros(values.shape[:2] + (length,), np.float32)
    layer, head, column = np.nonzero(positions >= 0)
    dense[layer, head, positions[layer, head, column]] = values[layer, head, column]
    return dense


def question_value(attention: np.ndarray, heads: "np.ndarray | None" = None) -> np.ndarray:
    """(L, Hkv, N) attention received by position -> what each position is worth to the question.
    `heads` None: each head's own, relative to the mean attention of the CONTRAST_WIDTH positions around it
    (attention falls with distance, and the first paragraphs take a large share of it whatever they say:
    what the question looks for stands out from its surroundings). `heads` (K, 2): one model-wide value a
    position, the sum over those (layer, KV head) pairs (the retrieval heads) of their attention as a share
    of its largest value."""
    if heads is None:
        return attention / (local_mean(attention, CONTRAST_WIDTH // 2) + np.float32(1e-6))
    listened = attention[heads[:, 0], heads[:, 1]]  # (K, N)
    listened = listened / (listened.max(axis=1, keepdims=True) + np.float32(1e-9))
    return np.broadcast_to(listened.sum(axis=0), attention.shape).copy()


def pool_over_spans(value: np.ndarray, spans: "TextSpans | None") -> np.ndarray:
    """(L, Hkv, N) -> (L, Hkv, N): each position takes the largest value over its prompt span (a sentence
    is picked whole), else over +-NEIGHBOURS positions (SnapKV's pooling)."""
    length = value.shape[-1]
    if spans is not None and spans.prompt_length:
        prompt = min(spans.prompt_length, length)
        value = value.copy()
        value[..., :prompt] = spans.segment_max(value[..., : spans.prompt_length])[..., :prompt]
        return value
    padded = np.pad(value, ((0, 0), (0, 0), (NEIGHBOURS, NEIGHBOURS)))
    return np.max([padded[..., shift : shift + length] for shift in range(2 * NEIGHBOURS + 1)], axis=0)


def pick(
    held_score: np.ndarray,  # (L, Hkv, C) the cached slots' scores after this append's ranking, old picks included
    held_positions: np.ndarray,  # (L, Hkv, C) int64, -1 empty
    leaving_score: np.ndarray,  # (L, Hkv, M) the leaving tokens' scores
    leaving_positions: np.ndarray,  # (L, Hkv, M)
    new_positions: np.ndarray,  # (T,) the append's positions, in the order of query_attention's new columns
    query_attention: np.ndarray,  # (L, Hkv, G, W, C + T)
    candidates_from: int,  # first position that is neither a sink nor ...
    candidates_to: int,  # ... in the window after this append: [from, to) compete for the long-range slots
    slots: int,  # how many of them get the bonus, per head
    spans: "TextSpans | None",
    heads: "np.ndarray | None" = None,  # (K, 2): one model-wide pick from these (layer, KV head) pairs, else each head's own
) -> tuple[np.ndarray, np.ndarray]:
    """The held and leaving scores with the old picks taken back and this question's `slots` picks added."""
    held_score = held_score - query_bonus(held_score)
    leaving_score = leaving_score - query_bonus(leaving_score)
    if slots <= 0:
        return held_score, leaving_score
    received = attention_received(query_attention)  # (L, Hkv, C + T)
    new_positions = np.broadcast_to(new_positions, (*received.shape[:2], len(new_positions)))
    every_position = np.concatenate([held_positions, new_positions], axis=2)
    competing = (every_position >= candidates_from) & (every_position < candidates_to)
    received = np.where(competing, received, np.float32(0))  # the sinks' and the window's attention spills onto no neighbour
    attention = by_position(received, every_position, int(every_position.max()) + 1)  # (L, Hkv, N)
    worth = question_value(attention, heads)
    own = attention if heads is None else worth
    worth = pool_over_spans(worth, spans) + np.float32(OWN_SHARE) * own  # ties inside a span or a neighbourhood: its own value first

    def value(positions: np.ndarray) -> np.ndarray:  # (L, Hkv, K) pooled attention, -inf for non-candidates
        candidate = (positions >= candidates_from) & (positions < candidates_to)
        looked_up = np.take_along_axis(worth, np.clip(positions, 0, worth.shape[2] - 1), axis=2)
        return np.where(candidate, looked_up, -np.inf)

    held_value, leaving_value = value(held_positions), value(leaving_positions)
    # Leaving tokens that are also held (old slots leaving the window) count once: as leaving.
    held_value = np.where(np.isin(held_positions, leaving_positions[0, 0]), -np.inf, held_value)
    every_value = np.concatenate([held_value, leaving_value], axis=2)  # (L, Hkv, C + M)
    slots = min(slots, every_value.shape[2])
    threshold = -np.partition(-every_value, slots - 1, axis=2)[..., slots - 1 : slots]  # (L, Hkv, 1) the slots-th largest
    threshold = np.where(np.isfinite(threshold), threshold, -np.finfo(np.float32).max)  # fewer candidates: every one
    held_score = held_score + np.where(held_value >= threshold, QUERY_BONUS, np.float32(0))
    leaving_score = leaving_score + np.where(leaving_value >= threshold, QUERY_BONUS, np.float32(0))
    return held_score.astype(np.float32), leaving_score.astype(np.float32)
