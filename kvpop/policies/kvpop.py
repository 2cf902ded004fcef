"""KVpop ("KVpop - Retrofitting LLMs with xLSTM-guided Token Eviction", NXAI / JKU Linz).

Budget B = s sinks + w protected recent tokens + k long-range slots. A token is scored only when it
LEAVES the window (so the scorer has seen w tokens of its future); its score is then fixed. The
leaving token competes with the kept long-range tokens and the lowest is evicted. Ranking all
non-protected candidates by their fixed scores and keeping the top is exactly that rule, applied to
every token that left during the append. The scorer is pluggable (see scorers.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvpop.policies.base import EvictionPolicy, StatisticsUpdate
from kvpop.policies.scorers import LeavingTokens, TokenScorer, make_scorer

SCORE = "kvpop_score"


@dataclass
class KVpopPolicy(EvictionPolicy):
    name = "kvpop"
    uses_sinks = True
    uses_window = True
    sinks: int = 4
    window: int = 64
    scorer: "str | TokenScorer" = "accumulated_attention"
    _scorer: TokenScorer = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.sinks < 0 or self.window < 0:
            raise ValueError(f"kvpop: sinks and window must be >= 0, got sinks={self.sinks} window={self.window}")
        self._scorer = make_scorer(self.scorer)

    @property
    def needs_attention(self) -> bool:
        return self._scorer.needs_attention

    @property
    def token_scorer(self) -> TokenScorer:
        return self._scorer

    def decodes_in_batch(self, cache) -> bool:
        """Whether this full cache's next one-token append may run vectorised with others
        (kvpop.cache.decode_batch): exactly one token leaves the window, the new token stays in it, an
        unprotected slot exists to drop, and the scorer can score a batch in this state."""
        sinks, window = self.protected_counts(cache.budget)
        return (
            window >= 1 and cache.budget >= sinks + window and cache.tokens_seen - window >= sinks
            and self._scorer.scores_decode_batch(cache.policy_state)
        )

    @property
    def statistics(self) -> tuple[str, ...]:
        return (SCORE, *self._scorer.statistics)

    def init_state(self):
        return self._scorer.init_state()  # the scorer's per-sequence state is the policy's

    def observe(self, cache, update) -> StatisticsUpdate:
        scorer_update = self._scorer.observe(cache, cache.policy_state, update)
        new_statistics = {**scorer_update.new, SCORE: np.zeros_like(update.key[..., 0], dtype=np.float32)}  # (L, Hkv, T)
        sinks, window = self.protected_counts(cache.budget)
        seen_after = cache.tokens_seen + update.num_tokens
        first, stop = max(cache.tokens_seen - window, sinks), seen_after - window  # leaving: [first, stop)
        if stop <= first:
            return StatisticsUpdate(new_statistics, scorer_update.cached)
        # The scorer's statistics as they are after this append (its update applied).
        statistics = {name: scorer_update.cached.get(name, cache.statistics[name]) for name in self._scorer.statistics}
        # Old slots holding leaving tokens (every head holds all of them: they were protected).
        held = (cache.position >= first) & (cache.position < stop)  # (L, Hkv, C)
        old_count = int(held[0, 0].sum())
        if old_count == 1:  # a decode step: one token leaves
            slots = held.argmax(axis=2)[..., None]  # (L, Hkv, 1)
        else:
            slots = np.argsort(~held, axis=2, kind="stable")[..., :old_count]  # (L, Hkv, M_old)
        # New tokens that leave on arrival (a chunk longer than the window).
        new_tokens = np.flatnonzero((update.positions >= first) & (update.positions < stop))  # (M_new,)

        def gather(old: np.ndarray, new: np.ndarray) -> np.ndarray:  # (L, Hkv, C|T, ...) -> (L, Hkv, M, ...)
            index = slots if old.ndim == 3 else slots[..., None]
            return np.concatenate([np.take_along_axis(old, index, axis=2), new[:, :, new_tokens]], axis=2)

        leaving = LeavingTokens(
            positions=gather(cache.position, np.broadcast_to(update.positions, new_statistics[SCORE].shape)),
            key=gather(cache.key, update.key),
            value=gather(cache.value, update.value),
            statistics={name: gather(statistics[name], new_statistics[name]) for name in self._scorer.statistics},
        )
        scores = np.asarray(self._scorer.score(cache, cache.policy_state, leaving), dtype=np.float32)
        cached_score = cache.statistics[SCORE].copy()  # (L, Hkv, C): the leaving old slots get their score
        np.put_along_axis(cached_score, slots, scores[..., :old_count], axis=2)
        new_statistics[SCORE][:, :, new_tokens] = scores[..., old_count:]
        return StatisticsUpdate(new_statistics, {**scorer_update.cached, SCORE: cached_score})

    def score(self, cache, candidates) -> np.ndarray:
        return candidates.statistics[SCORE]
