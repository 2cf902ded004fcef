"""What a caller hands the engine and what it gets back: requests, token events, results.

A leaf of the runtime: the engine, the cache manager, admission and the serving layer all speak these
types, and this module imports only the sampling parameters and the policy registry (to check a cache
configuration when it is made, not when it first runs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum

from kvpop.policies import POLICIES, make_policy
from kvpop.sampling import SamplingParams
from kvpop.policies.kvpop import LEARNED_SCORER_KINDS

NO_TOKEN = -1  # token_id of an event that carries no token (a cancellation)


class FinishReason(StrEnum):
    STOP = "stop"  # an end-of-sequence token or a stop string
    LENGTH = "length"  # max_tokens, or the model's last position
    CANCELLED = "cancelled"


class Tier(StrEnum):
    """Where a session's saved state was found (kvpop.sessions.store)."""

    HOT = "hot"  # instance memory, counted in the KV pool
    WARM = "warm"  # instance memory beside the pool
    COLD = "cold"  # a checkpoint file on disk


@dataclass
class CacheConfig:
    """Which policy keeps a request's cache, and how many slots per head it may use.

    Give `budget` (slots per head) or `compression` (0 <= r < 1; budget = ceil((1 - r) * (prompt
    tokens + max_tokens))), not both; `full` takes neither. `sinks`, `window` and `seed` reach the
    policies that have such a field (streaming: sinks; h2o: window; random: seed; kvpop: sinks,
    window) and are clamped so that sinks + window fit in the budget (kvpop's window also shrinks to a
    quarter of a tight budget, never under 32 tokens: KVpopPolicy.protected_counts). `scorer` is the
    kvpop policy's alone: every other policy ignores it (a service passes its kvpop scorer with every
    request).
    """

    policy: str = "full"
    budget: int | None = None
    compression: float | None = None
    sinks: int = 4
    window: int = 64
    seed: int = 0  # random policy
    scorer: str = "accumulated_attention"  # kvpop only: a built-in scorer or one of LEARNED_SCORER_KINDS
    span_pooling: str | None = None  # kvpop only: how prompt tokens are ranked by span; None: the scorer's own
    query_window: int | None = None  # kvpop only: the prompt's last queries that pick slots; None: the policy's default
    fill: str | None = None  # kvpop only: what ranks the slots the question does not pick ("scorer", "recency"); None: scorer

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown eviction policy {self.policy!r}; registered: {', '.join(POLICIES)}")
        bounded = POLICIES[self.policy].evicts
        if not bounded and (self.budget is not None or self.compression is not None):
            raise ValueError("policy 'full' keeps every token: give neither budget nor compression")
        if bounded and (self.budget is None) == (self.compression is None):
            raise ValueError(f"policy {self.policy!r} needs exactly one of budget (slots) or compression (ratio)")
        if self.budget is not None and (isinstance(self.budget, bool) or int(self.budget) != self.budget or self.budget < 1):
            raise ValueError(f"budget must be a positive whole number of slots per head, got {self.budget!r}")
        if self.compression is not None and not 0.0 <= self.compression < 1.0:
            raise ValueError(f"compression must be in [0, 1), got {self.compression!r}")
        if self.sinks < 0 or self.window < 0:
            raise ValueError(f"sinks and window must be >= 0, got sinks={self.sinks} window={self.window}")
        if self.learned_scorer is None:
            self.build_policy()  # fails here, with the policy's own message, on bad options

    @property
    def learned_scorer(self) -> str | None:
        """The learned scorer kind this request needs from the engine (kvpop only), or None."""
        return self.scorer if self.policy == "kvpop" and self.scorer in LEARNED_SCORER_KINDS else None

    def resolve_budget(self, prompt_tokens: int, max_tokens: int) -> int | None:
        """Slots per head for a request of this size; None for the unbounded full cache."""
        if self.budget is not None:
            return int(self.budget)
        if self.compression is None:
            return None
        return max(1, math.ceil((1.0 - self.compression) * (prompt_tokens + max_tokens)))

    def build_policy(self, learned_scorers: dict | None = None):
        """The policy instance; a learned scorer resolves to the engine's loaded network (`learned_scorers`,
        by kind), whose protected window (the one it was trained for) replaces `window`."""
        kvpop_options = {name: value for name, value in (("span_pooling", self.span_pooling), ("query_window", self.query_window),
                                                         ("fill", self.fill)) if value is not None}
        return make_policy(self.policy, learned_scorers or {}, sinks=self.sinks, window=self.window, seed=self.seed,
                           scorer=self.scorer, **kvpop_options)


@dataclass
class GenerationRequest:
    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    cache: CacheConfig = field(default_factory=CacheConfig)
    # Keep the sequence's state when it ends, and start from the session's saved state when the
    # prompt begins with the tokens that state has seen (needs an engine with a session store).
    session_id: str | None = None
    end_session: bool = False  # the session's last turn: forget its state instead of keeping it

    def __post_init__(self) -> None:
        self.prompt_ids = [int(token) for token in self.prompt_ids]
        if not self.prompt_ids:
            raise ValueError(f"request {self.request_id!r}: prompt_ids is empty")


@dataclass
class TokenEvent:
    request_id: str
    token_id: int  # NO_TOKEN (-1) for a cancellation
    finished: bool
    finish_reason: FinishReason | None  # once finished
    text: str = ""  # the answer's text this token completed (an engine with a tokenizer; kvpop.engine.detokenizer)


@dataclass
class GenerationResult:
    request_id: str
    prompt_ids: list[int]
    output_ids: list[int]  # every generated token: a final EOS (as Hugging Face generate) and a stop string's tokens too
    finish_reason: FinishReason
    budget: int  # slots per head (for full: the tokens it ended up holding)
    peak_kv_bytes: int  # largest key + value storage this sequence held
    tokens_evicted: int  # per head (every head evicts the same number)
    compression: float  # 1 - cached tokens / tokens seen
    tokens_seen: int = 0
    policy: str = "full"
    matched_stop: str | None = None  # the stop string that ended it, if any (its tokens stay in output_ids)
    text: str = ""  # the answer's text (special tokens skipped), ending before a stop string; "" without a tokenizer
    tokens_reused: int = 0  # prompt tokens taken from a saved session or a warm prefix (not computed)
    session_tier: Tier | None = None  # where the session's state was found, if it was
    prefix_lookup: bool = False  # the warm prefixes were searched (no session state continued it)
    prefix_tokens_reused: int = 0  # of tokens_reused, those a warm prefix held


__all__ = [
    "NO_TOKEN", "CacheConfig", "FinishReason", "GenerationRequest", "GenerationResult",
    "SamplingParams", "Tier", "TokenEvent",
]
