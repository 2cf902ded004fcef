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
from pathlib import Path
from typing import Any, ClassVar, Hashable

import numpy as np

from kvpop.kvtypes import CacheUpdate, CacheView, Candidates, StagedChunk, StatisticsUpdate

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
    # > 0: reads a whole prompt's last `query_window` queries (CacheUpdate.query_attention) when the prompt
    # enters at once; the engine then runs those last tokens as their own piece, with attention.
    query_window: int = field(default=0, init=False, repr=False)

    # A deployment's settings of this policy (a dataclass of strings read from config.pbtxt parameters named
    # `<name>_<setting>`) with `options(assets) -> dict`: the options every request of the policy then gets
    # (kvpop.policies.registry.policy_settings). None: the policy has no settings.
    Settings: ClassVar[type | None] = None

    @classmethod
    def from_options(cls, options: Any, assets: Any = None) -> "EvictionPolicy":
        """The policy for a request's options (its options object: kvpop.policies.registry.policy_options).
        `assets`: what it loaded for the model (`load_assets`), for a policy that runs one (kvpop's scorers)."""
        return cls(**{option.name: getattr(options, option.name) for option in fields(options)})

    @classmethod
    def check_options(cls, options: Any) -> None:
        """ValueError, with the policy's own message, on options no model could run (a cache configuration
        is checked when it is made; default: build the policy without assets)."""
        cls.from_options(options)

    @classmethod
    def load_assets(cls, model_dir: Path) -> Any:
        """What this policy loads once per exported model, shared by every sequence (default: nothing)."""
        return None

    def init_state(self) -> Any:
        """A new sequence's policy state, which its cache keeps (default: none)."""
        return None

    def prompt_state(self, prompt_ids: list[int], tokenizer: Any, vocab_size: int) -> Any:
        """What this policy keeps of a new request's prompt (`cache.prompt_state`; default nothing).
        `tokenizer` may be None (an engine without one)."""
        return None

    def decode_group(self, cache: CacheView) -> Hashable | None:
        """A key under which this cache's next one-token append may run vectorised with the other caches
        of that key (`append_decode_group`); None (the default): appended one by one."""
        return None

    def append_decode_group(self, caches: list, rows: np.ndarray, pool: Any, new_key: np.ndarray, new_value: np.ndarray,
                            last: Any) -> Any:
        """Append a decode step's new tokens (L, B, Hkv, 1, D) of `rows` of the batch pool to `caches`, which
        share a `decode_group` key, at once; returns what the next step of the same group may reuse (`last`)."""
        raise NotImplementedError(f"policy {self.name!r} has no vectorised decode append")

    def encode_state(self, state: Any) -> tuple[dict, dict[str, np.ndarray]]:
        """(JSON description, arrays named `policy.*`) of a sequence's policy state, for a session
        checkpoint (copies; never pickled). Default: a policy without state."""
        if state is None:
            return {"kind": "none"}, {}
        raise TypeError(f"cannot save a policy state of type {type(state).__name__}")

    def decode_state(self, description: dict, arrays: dict[str, np.ndarray]) -> Any:
        """The live policy state of an `encode_state` description (a restored sequence owns its copies)."""
        kind = description.get("kind")
        if kind == "none":
            return None
        raise ValueError(f"unknown policy state kind {kind!r}")

    @classmethod
    def prepare(cls, assets: Any, tokenizer: Any, vocab_size: int) -> None:
        """Build, once per model, what `prompt_state` will need, before the first request (default nothing).
        `assets`: this policy's (`load_assets`), or None."""

    def observe(self, cache: CacheView, update: CacheUpdate) -> StatisticsUpdate:
        """The statistics after the new tokens: theirs (L, Hkv, T) and the cached slots' that changed."""
        return StatisticsUpdate()

    def stage(self, cache: CacheView, staged: StagedChunk, rows: slice, chunk_length: int) -> None:
        """Rows `rows` of a prompt chunk of `chunk_length` tokens were computed, held in `staged`, which
        enters `cache` whole (`observe` then sees the whole chunk) once complete. A policy may take the
        rows into its state now, so that the completing step does less; by default nothing happens."""

    @abstractmethod
    def score(self, cache: CacheView, candidates: Candidates) -> np.ndarray:
        """(L, Hkv, C + T) priority to keep each candidate; the lowest are evicted."""

    # -- shared mechanics -----------------------------------------------------------------------

    def protected_counts(self, budget: int) -> tuple[int, int]:
        """(sinks, window) actually protected under `budget` slots per head."""
        sinks = min(getattr(self, "sinks", 0), budget) if self.uses_sinks else 0
        window = min(getattr(self, "window", 0), budget - sinks) if self.uses_window else 0
        return sinks, window

    def keep_priority(self, cache: CacheView, candidates: Candidates) -> np.ndarray:
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


def accumulate_attention(cache: CacheView, update: CacheUpdate, statistic: str) -> StatisticsUpdate:
    """`statistic` plus what the new queries put on each cached slot; the new tokens' own totals
    (what later tokens of the same chunk put on them); a whole prompt's from every one of its queries
    (`CacheUpdate.prompt_attention`). Shared by h2o and kvpop."""
    if update.prompt_attention is not None:
        received = update.prompt_attention.sum(axis=2)  # (L, Hkv, C + T)
        capacity = received.shape[2] - update.num_tokens
        return StatisticsUpdate(new={statistic: received[..., capacity:]},
                                cached={statistic: cache.statistics[statistic] + received[..., :capacity]})
    return StatisticsUpdate(
        new={statistic: group_attention(update.chunk_attention)},
        cached={statistic: cache.statistics[statistic] + group_attention(update.attention)},
    )
