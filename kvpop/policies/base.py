"""The one interface every eviction policy implements, and the shared mechanics they reuse.

A policy never moves data and never writes into the cache: it reads the cache and says what it
decided, and the slot cache applies it. The contract, per sequence:
  - `init_state()` returns the policy's per-sequence state (or None); the cache stores it in
    `cache.policy_state` and hands it back by that attribute (a session checkpoint saves it).
  - `observe(cache, update)` returns a `StatisticsUpdate`: every statistic's values for the T new
    tokens, and new values for the C cached slots of the statistics that changed. The cache applies
    it before it writes the new tokens.
  - `score(cache, candidates)` ranks the old slots and new tokens of an over-budget append; the cache
    does the top-k and the overwriting, so a new policy is one small file with one `score` method
    (as kvpress presses are).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

if TYPE_CHECKING:
    from kvpop.cache.staged_chunk import StagedChunk
    from kvpop.cache.slot_cache import Candidates, CacheUpdate, SlotCache

PROTECTED = np.float32(np.inf)  # priority of a token a policy promises never to evict


@dataclass
class StatisticsUpdate:
    """What a policy concluded from one append; the slot cache applies it (the cache takes over the
    arrays: a policy returns fresh ones, never views of the cache's own statistics)."""

    new: dict[str, np.ndarray] = field(default_factory=dict)  # name -> (L, Hkv, T): every statistic, for the new tokens
    cached: dict[str, np.ndarray] = field(default_factory=dict)  # name -> (L, Hkv, C): new values of the cached slots; absent: unchanged


@dataclass
class EvictionPolicy(ABC):
    """Base class: subclasses are dataclasses whose fields are their configuration.

    `sinks` first tokens and the `window` most recent tokens are protected when the subclass says
    it honours them (`uses_sinks` / `uses_window`); both are clamped so they fit in the budget.
    """

    name: ClassVar[str]
    statistics: ClassVar[tuple[str, ...]] = ()  # per-slot float statistics the cache stores for it
    uses_sinks: ClassVar[bool] = False
    uses_window: ClassVar[bool] = False
    evicts: ClassVar[bool] = True  # False only for the full cache
    needs_attention: ClassVar[bool] = False  # reads CacheUpdate.attention (the step must return it)
    span_pooling: ClassVar[str] = ""  # ranks prompt tokens by line (text_spans.py): the engine sets SlotCache.text_spans

    @classmethod
    def from_options(cls, learned_scorers: dict | None, **options: Any) -> "EvictionPolicy":
        """The policy for a request's options: those it has as fields (the rest belong to other policies).
        `learned_scorers`: the engine's loaded scorer networks by kind, for a policy that runs one."""
        accepted = {field.name for field in fields(cls) if field.init}
        return cls(**{key: value for key, value in options.items() if key in accepted})

    def init_state(self) -> Any:
        """A new sequence's policy state, which its cache keeps (default: none)."""
        return None

    def observe(self, cache: "SlotCache", update: "CacheUpdate") -> StatisticsUpdate:
        """The statistics after the new tokens: theirs (L, Hkv, T) and the cached slots' that changed."""
        return StatisticsUpdate()

    def stage(self, cache: "SlotCache", staged: "StagedChunk", rows: slice, chunk_length: int) -> None:
        """Rows `rows` of a prompt chunk of `chunk_length` tokens were computed, held in `staged`, which
        enters `cache` whole (`observe` then sees the whole chunk) once complete. A policy may take the
        rows into its state now, so that the completing step does less; by default nothing happens."""

    @abstractmethod
    def score(self, cache: "SlotCache", candidates: "Candidates") -> np.ndarray:
        """(L, Hkv, C + T) priority to keep each candidate; the lowest are evicted."""

    # -- shared mechanics -----------------------------------------------------------------------

    def protected_counts(self, budget: int) -> tuple[int, int]:
        """(sinks, window) actually protected under `budget` slots per head."""
        sinks = min(getattr(self, "sinks", 0), budget) if self.uses_sinks else 0
        window = min(getattr(self, "window", 0), budget - sinks) if self.uses_window else 0
        return sinks, window

    def keep_priority(self, cache: "SlotCache", candidates: "Candidates") -> np.ndarray:
        """`score`, with protected sinks and window raised above every other candidate."""
        priority = np.asarray(self.score(cache, candidates), dtype=np.float32)
        sinks, window = self.protected_counts(candidates.capacity)
        positions = candidates.positions
        protected = (positions >= 0) & (positions < sinks)
        if window:
            protected |= positions >= candidates.tokens_seen - window
        return np.where(protected, PROTECTED, priority)


def group_attention(attention: np.ndarray, reduce: str = "sum") -> np.ndarray:
    """(L, Hkv, G, T, S) -> (L, Hkv, S): attention a slot received, summed over the new queries and
    reduced over the query heads of its GQA group ("sum" or "mean")."""
    received = attention.sum(axis=3)  # (L, Hkv, G, S)
    return received.mean(axis=2) if reduce == "mean" else received.sum(axis=2)


def accumulate_attention(cache: "SlotCache", update: "CacheUpdate", statistic: str) -> StatisticsUpdate:
    """`statistic` plus what the new queries put on each cached slot; the new tokens' own totals
    (what later tokens of the same chunk put on them). Shared by h2o and kvpop."""
    return StatisticsUpdate(
        new={statistic: group_attention(update.chunk_attention)},
        cached={statistic: cache.statistics[statistic] + group_attention(update.attention)},
    )
