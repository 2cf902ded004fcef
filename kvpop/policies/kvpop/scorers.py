"""Scorers for the kvpop policy: what decides a token's worth when it leaves the protected window.

The learned scorers (ONNX mLSTM or MLP per KV head, `kvpop.policies.kvpop.runtime.LearnedScorer`) implement
this interface; the attention-based `AccumulatedAttentionScorer` below is the stand-in used when a
model has none. `init_state` returns per-sequence recurrent state (the kvpop policy's state, kept in
the slot cache, so it travels with the sequence), `observe` sees every new token's key and value
once, in order (a scorer that `catches_up` may see a cache's first tokens late, all at once, when
the cache first has to evict), and returns its statistics as a `StatisticsUpdate` (the same contract as a policy's),
and `score` is called only for the tokens leaving the window now. Scores are fixed once given.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from kvpop.kvtypes import StatisticsUpdate
from kvpop.policies.base import accumulate_attention

if TYPE_CHECKING:
    from kvpop.kvtypes import CacheUpdate, CacheView as SlotCache


@dataclass
class LeavingTokens:
    """The M tokens leaving the protected window in one append (M is the same for every head)."""

    positions: np.ndarray  # (L, Hkv, M) int64
    key: np.ndarray | None  # (L, Hkv, M, D); None when the scorer scored them as their chunk's pieces came
    value: np.ndarray | None  # (L, Hkv, M, D)
    statistics: dict[str, np.ndarray]  # the scorer's own statistics, name -> (L, Hkv, M)


class TokenScorer(ABC):
    name: ClassVar[str]
    statistics: ClassVar[tuple[str, ...]] = ()  # per-slot statistics the cache keeps for this scorer
    needs_attention: ClassVar[bool] = False  # reads the attention the decoder step returns

    def init_state(self) -> Any:
        """Per-sequence state (e.g. recurrent memory per head); the kvpop policy's state in the cache."""
        return None

    def observe(self, cache: "SlotCache", state: Any, update: "CacheUpdate") -> StatisticsUpdate:
        """See the new tokens; their statistics (L, Hkv, T) and the cached slots' that changed."""
        return StatisticsUpdate()

    @abstractmethod
    def score(self, cache: "SlotCache", state: Any, leaving: LeavingTokens) -> np.ndarray:
        """(L, Hkv, M) worth of the leaving tokens; higher is kept."""

    @property
    def takes_pieces(self) -> bool:
        """Whether `take_piece` may run a staged chunk's pieces through the scorer before its append."""
        return False

    @property
    def shared_ranking(self) -> bool:
        """Whether every cache of the model ranks a token by one score (a span ranking needs it)."""
        return False

    @property
    def retrieval_heads(self) -> "np.ndarray | None":
        """(K, 2) the (layer, KV head) pairs whose question attention finds what a question asks about
        (kvpop_train.scorer.retrieval_heads), or None: a learned scorer's model ships them."""
        return None

    @property
    def span_pooling(self) -> str:
        """How the kvpop policy ranks prompt tokens (kvpop.policies.kvpop.text_spans): "" by their own score,
        "line" / "line_contrast" by their line's: for a scorer whose one model-wide ranking was chosen that way."""
        return ""

    @property
    def catches_up(self) -> bool:
        """Whether the kvpop policy may leave the scorer out while a cache has never had to evict, and
        hand it the cache's tokens at once when it first must (it reads only keys and values, all still
        in the cache then: nothing it would have seen is lost)."""
        return False

    def take_piece(
        self,
        state: Any,
        new_key: np.ndarray,  # (L, Hkv, t, D): rows of a prompt chunk that enters the cache later, whole
        new_value: np.ndarray,  # (L, Hkv, t, D)
        leaving_positions: np.ndarray,  # (t,) the token leaving the window at each row, -1: none
        leaving_key: np.ndarray,  # (L, Hkv, t, D), zeros where none leaves
        leaving_value: np.ndarray,  # (L, Hkv, t, D)
    ) -> None:
        """Take rows of a chunk computed in pieces in before the chunk's append (kvpop policy `stage`)."""
        raise NotImplementedError(f"scorer {self.name!r} does not take chunks in pieces")

    def scored_in_pieces(self, state: Any) -> bool:
        """Whether the append being observed is a chunk whose leaving tokens were scored as its pieces
        were computed (the kvpop policy's `stage`): `score` then needs no keys or values."""
        return False

    def scores_decode_batch(self, state: Any) -> bool:
        """Whether `score_decode_batch` may replace observe + score for a decode step in `state`."""
        return False

    def score_decode_batch(
        self,
        states: list[Any],
        new_key: np.ndarray,  # (B, L, Hkv, D): each sequence's one new token
        new_value: np.ndarray,  # (B, L, Hkv, D)
        leaving_key: np.ndarray,  # (B, L, Hkv, D): the token leaving each head's window
        leaving_value: np.ndarray,  # (B, L, Hkv, D)
    ) -> np.ndarray:
        """(B, L, Hkv) scores of the leaving tokens of B sequences' decode steps, each state advanced
        exactly as `observe` then `score` of one token would (kvpop.policies.kvpop.decode_batch)."""
        raise NotImplementedError(f"scorer {self.name!r} does not score decode batches")


class AccumulatedAttentionScorer(TokenScorer):
    """Score = attention the token received while it sat in the protected window (summed over the
    queries and the query heads of its group): an attention-based stand-in for the learned scorer,
    close in spirit to its "future attention" training target."""

    name = "accumulated_attention"
    statistics = ("accumulated_attention",)
    needs_attention = True

    def observe(self, cache, state, update) -> StatisticsUpdate:
        return accumulate_attention(cache, update, "accumulated_attention")

    def score(self, cache, state, leaving) -> np.ndarray:
        return leaving.statistics["accumulated_attention"]


SCORERS: dict[str, type[TokenScorer]] = {
    scorer.name: scorer for scorer in (AccumulatedAttentionScorer,)
}


def make_scorer(scorer: "str | TokenScorer") -> TokenScorer:
    if isinstance(scorer, TokenScorer):
        return scorer
    if scorer not in SCORERS:
        raise ValueError(f"unknown kvpop scorer {scorer!r}; registered: {', '.join(sorted(SCORERS))}")
    return SCORERS[scorer]()
