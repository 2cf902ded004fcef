"""Eviction policies, one per module, registered by name.

A new policy: one module with a dataclass subclass of `EvictionPolicy`, added to `POLICIES`; the
test matrix in tests/policies/test_policies.py picks it up and demands a constructed eviction case for it.
"""

from __future__ import annotations

from typing import Any

from kvpop.kvtypes import StatisticsUpdate
from kvpop.policies.base import EvictionPolicy
from kvpop.policies.full import FullPolicy
from kvpop.policies.h2o import H2OPolicy
from kvpop.policies.keep_start import KeepStartPolicy
from kvpop.policies.kvpop import KVpopPolicy, load_learned_scorers
from kvpop.policies.random import RandomPolicy
from kvpop.policies.snapkv import SnapKVPolicy
from kvpop.policies.kvpop.scorers import SCORERS, AccumulatedAttentionScorer, LeavingTokens, TokenScorer
from kvpop.policies.streaming import StreamingPolicy
from kvpop.policies.tova import TOVAPolicy

POLICIES: dict[str, type[EvictionPolicy]] = {
    policy.name: policy
    for policy in (FullPolicy, StreamingPolicy, H2OPolicy, TOVAPolicy, RandomPolicy, KVpopPolicy, KeepStartPolicy, SnapKVPolicy)
}


def make_policy(name: str, learned_scorers: dict[str, TokenScorer] | None = None, **options: Any) -> EvictionPolicy:
    """Build policy `name` from request options (sinks, window, seed, scorer...): each policy takes the
    ones it has (`EvictionPolicy.from_options`); `learned_scorers` are the engine's loaded networks (None:
    a scorer is named by its built-in name only)."""
    if name not in POLICIES:
        raise ValueError(f"unknown eviction policy {name!r}; registered: {', '.join(POLICIES)}")
    return POLICIES[name].from_options(learned_scorers, **options)


__all__ = [
    "POLICIES",
    "SCORERS",
    "StatisticsUpdate",
    "AccumulatedAttentionScorer",
    "EvictionPolicy",
    "LeavingTokens",
    "TokenScorer",
    "load_learned_scorers",
    "make_policy",
]
