"""The one interface every eviction policy implements, and the shared mechanics they reuse.

A policy never moves data: it keeps per-slot statistics up to date (`observe`) and ranks the old
slots and new tokens of an over-budget append (`score`). The slot cache does the top-k and the
overwriting, so a new policy is one small file with one `score` method (as kvpress presses are).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import numpy as np

if TYPE_CHECKING:
    from kvpop.cache.slot_cache import Candidates, CacheUpdate, SlotCache

PROTECTED = np.float32(np.inf)  # priority of a token a policy promises never to evict


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

    def init_state(self, cache: "SlotCache") -> None:
        """Create per-sequence state in `cache.policy_state` (default: none)."""

    def observe(self, cache: "SlotCache", update: "CacheUpdate") -> dict[str, np.ndarray]:
        """Update statistics of the cached slots; return each statistic for the new tokens (L, Hkv, T)."""
        return {}

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


def accumulate_attention(cache: "SlotCache", update: "CacheUpdate", statistic: str) -> np.ndarray:
    """Add what the new queries put on each cached slot to `statistic`; return the new tokens' own
    totals (what later tokens of the same chunk put on them). Shared by h2o and kvpop."""
    cache.statistics[statistic] += group_attention(update.attention)
    return group_attention(update.chunk_attention)
