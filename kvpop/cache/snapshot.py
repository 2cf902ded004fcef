"""A slot cache as a detached `SessionState` (a copy), and a new cache continuing one: how a session's
turn and a warm prefix are kept and resumed. The policy encodes its own per-sequence state
(`EvictionPolicy.encode_state`)."""

from __future__ import annotations

from typing import Any

import numpy as np

from kvpop.cache.slot_cache import SlotCache
from kvpop.model_spec import ModelSpec
from kvpop.policies import EvictionPolicy
from kvpop.sessions.state import SessionState


def capture_state(cache: SlotCache, tokens: list[int], fingerprint: str, cache_options: dict[str, Any]) -> SessionState:
    """A copy of `cache` (its arrays may be views into the batch pool) with the tokens it has seen."""
    if len(tokens) != cache.tokens_seen:
        raise ValueError(f"the cache has seen {cache.tokens_seen} tokens, the history has {len(tokens)}")
    description, policy_arrays = cache.policy.encode_state(cache.policy_state)
    return SessionState(
        fingerprint=fingerprint,
        cache_options=dict(cache_options),
        budget=cache.budget,
        tokens=np.array(tokens, np.int64),
        length=cache.length,
        peak_bytes=cache.peak_bytes,
        key=np.array(cache.key),
        value=np.array(cache.value),
        position=np.array(cache.position),
        statistics={name: np.array(stat) for name, stat in cache.statistics.items()},
        policy_state=description,
        policy_arrays=policy_arrays,
    )


def restore_cache(state: SessionState, spec: ModelSpec, policy: EvictionPolicy) -> SlotCache:
    """A new slot cache continuing `state` (owns copies of every array: the state stays reusable)."""
    cache = SlotCache(spec, policy, state.budget)
    expected = (spec.num_layers, spec.num_kv_heads)
    if state.key.shape[:2] != expected or state.key.shape[3] != spec.head_dim or state.key.shape != state.value.shape:
        raise ValueError(f"saved cache of shape {state.key.shape} does not fit the model ({expected}, D={spec.head_dim})")
    if set(state.statistics) != set(cache.statistics):
        raise ValueError(f"saved statistics {sorted(state.statistics)} are not the policy's {sorted(cache.statistics)}")
    cache.key, cache.value = np.array(state.key), np.array(state.value)
    cache.position = np.array(state.position)
    cache.statistics = {name: np.array(stat) for name, stat in state.statistics.items()}
    cache.length, cache.tokens_seen, cache.peak_bytes = state.length, state.tokens_seen, state.peak_bytes
    cache.policy_state = policy.decode_state(state.policy_state, state.policy_arrays)
    return cache
