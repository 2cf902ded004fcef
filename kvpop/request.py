"""What a caller hands the engine and what it gets back: requests, token events, results.

A leaf of the runtime: the engine, the cache manager and the serving layer all speak these types, and
this module imports only the sampling parameters and the policy registry (a cache configuration's policy
name and options are checked when it is made; the policy is built by the engine that runs it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Mapping

from kvpop.policies.registry import make_policy, policy_class, policy_options
from kvpop.sampling import SamplingParams

if TYPE_CHECKING:
    from kvpop.policies.base import EvictionPolicy

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
    """Which policy keeps a request's cache, how many slots per head it may use, and the policy's options.

    Give `budget` (slots per head) or `compression` (0 <= r < 1; budget = ceil((1 - r) * (prompt
    tokens + max_tokens))), not both; `full` takes neither. `options` is the policy's own options object
    (`kvpop.policies.registry.policy_options`: its dataclass fields, e.g. streaming's sinks, random's seed,
    kvpop's sinks, window, scorer...); a mapping is resolved to it, keeping the keys the policy has. The
    policy itself is built once per sequence, by the engine that runs it (with the model's assets).
    """

    policy: str = "full"
    budget: int | None = None
    compression: float | None = None
    options: Any = None

    def __post_init__(self) -> None:
        bounded = policy_class(self.policy).evicts
        if not bounded and (self.budget is not None or self.compression is not None):
            raise ValueError(f"policy {self.policy!r} keeps every token: give neither budget nor compression")
        if bounded and (self.budget is None) == (self.compression is None):
            raise ValueError(f"policy {self.policy!r} needs exactly one of budget (slots) or compression (ratio)")
        if self.budget is not None and (isinstance(self.budget, bool) or int(self.budget) != self.budget or self.budget < 1):
            raise ValueError(f"budget must be a positive whole number of slots per head, got {self.budget!r}")
        if self.compression is not None and not 0.0 <= self.compression < 1.0:
            raise ValueError(f"compression must be in [0, 1), got {self.compression!r}")
        self.options = policy_options(self.policy, self.options)
        policy_class(self.policy).check_options(self.options)  # fails here, with the policy's own message

    def resolve_budget(self, prompt_tokens: int, max_tokens: int) -> int | None:
        """Slots per head for a request of this size; None for the unbounded full cache."""
        if self.budget is not None:
            return int(self.budget)
        if self.compression is None:
            return None
        return max(1, math.ceil((1.0 - self.compression) * (prompt_tokens + max_tokens)))

    def build_policy(self, assets: "Mapping[str, Any] | None" = None) -> "EvictionPolicy":
        """A new policy instance; `assets`: the model's, by policy name (kvpop.policies.registry.load_policy_assets)."""
        return make_policy(self.policy, self.options, assets)


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
    degraded_from: int | None = None  # the budget asked for, when admission gave it `budget` instead (a tight KV pool)
    started: bool = True  # False: it ended (cancelled) before it entered the running batch


__all__ = [
    "NO_TOKEN", "CacheConfig", "FinishReason", "GenerationRequest", "GenerationResult",
    "SamplingParams", "Tier", "TokenEvent",
]
