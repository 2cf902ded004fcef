"""TOVA (Oren et al., 2024, "Transformers are Multi-State RNNs").

Evicts the token with the lowest attention from the current (most recent) query, averaged over the
query heads of the token's GQA group. No sinks or window: TOVA keeps them only if they are attended.
A whole prompt entering at once is ranked by its last query (the end of the question).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvpop.kvtypes import StatisticsUpdate
from kvpop.policies.base import EvictionPolicy, group_attention


@dataclass
class TOVAPolicy(EvictionPolicy):
    name = "tova"
    statistics = ("last_query_attention",)
    needs_attention = True

    def observe(self, cache, update) -> StatisticsUpdate:
        # Only the last new query counts: it is the "current" one when the eviction happens.
        if update.attention is None:  # a whole prompt (CacheUpdate.prompt_attention): its last query, from the question's rows
            if update.query_attention is None:
                raise ValueError("tova: a whole prompt's append needs its last queries' attention (query_attention)")
            last = group_attention(update.query_attention[..., -1:, :], "mean")  # (L, Hkv, C + T)
            capacity = last.shape[2] - update.num_tokens
            return StatisticsUpdate(new={"last_query_attention": last[..., capacity:]},
                                    cached={"last_query_attention": last[..., :capacity]})
        return StatisticsUpdate(
            new={"last_query_attention": group_attention(update.chunk_attention[..., -1:, :], "mean")},
            cached={"last_query_attention": group_attention(update.attention[..., -1:, :], "mean")},
        )

    def score(self, cache, candidates) -> np.ndarray:
        return candidates.statistics["last_query_attention"]
