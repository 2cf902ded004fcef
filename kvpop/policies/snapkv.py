"""SnapKV (Li et al., 2024, "SnapKV: LLM Knows What You are Looking for Before Generation").

When a whole prompt enters at once, the attention of its last OBSERVATION_WINDOW queries (the question)
ranks every earlier token, per KV head: summed over the window's queries and the head's
query group, max-pooled over a token's neighbours (kvpop.policies.kvpop.query: NEIGHBOURS on each side),
and the highest fill the budget beside the protected recent `window` (which holds the observation window). Tokens that arrive later (the answer) keep their
place ahead of the prompt's: the prompt's lowest-ranked go first. A prompt that arrives in chunks (no
question to read) is ranked by recency alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvpop.kvtypes import StatisticsUpdate
from kvpop.policies.base import EvictionPolicy
from kvpop.policies.kvpop.query import attention_received, by_position, pool_over_spans

OBSERVATION_WINDOW = 32  # the prompt's last queries that rank the rest (the question), as kvpop's (query.WINDOW)
LATER = np.float32(1e6)  # the rank of a token that arrived after the last whole prompt: above every pooled attention


@dataclass
class SnapKVPolicy(EvictionPolicy):
    name = "snapkv"
    statistics = ("question_attention",)
    uses_window = True
    window: int = 64  # the protected recent tokens (as H2O's), the observation window among them
    query_window: int = field(default=OBSERVATION_WINDOW, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.window < 0:
            raise ValueError(f"snapkv: window must be >= 0, got {self.window}")

    def observe(self, cache, update) -> StatisticsUpdate:
        if update.query_attention is None:  # decoded tokens, or a prompt in chunks: newest kept first
            later = LATER + update.positions.astype(np.float32) / np.float32(1e6)
            return StatisticsUpdate(new={"question_attention": np.broadcast_to(later, update.key.shape[:3]).copy()})
        received = attention_received(update.query_attention)  # (L, Hkv, C + T)
        every = np.concatenate([cache.position, np.broadcast_to(update.positions, update.key.shape[:3])], axis=2)
        pooled = pool_over_spans(by_position(received, every, int(every.max()) + 1), None)  # (L, Hkv, N) by position
        ranked = np.take_along_axis(pooled, np.maximum(every, 0), axis=2)  # (L, Hkv, C + T)
        capacity = cache.position.shape[2]
        return StatisticsUpdate(new={"question_attention": ranked[..., capacity:]},
                                cached={"question_attention": ranked[..., :capacity]})

    def score(self, cache, candidates) -> np.ndarray:
        return candidates.statistics["question_attention"]
