"""`SessionState`: everything needed to continue a finished sequence exactly, detached from any engine.

A turn ends with the sequence's cache holding every token it was fed (the prompt and all outputs but
the last, which was sampled and never fed). The next turn's prompt must begin with exactly those
tokens (`tokens`); then only the rest is prefilled into a copy of the saved cache. Storing the token
history, not only the slots, is what makes reuse safe: a prompt that does not start with it (an
edited conversation, another client guessing the id) simply gets a cold prefill.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from kvpop.sessions.policy_state import decode_policy_state, encode_policy_state

if TYPE_CHECKING:
    from kvpop.cache.slot_cache import SlotCache
    from kvpop.model_spec import ModelSpec
    from kvpop.policies.base import EvictionPolicy


@dataclass
class SessionState:
    fingerprint: str  # model + scorer fingerprint (kvpop.sessions.fingerprint)
    cache_options: dict[str, Any]  # the CacheConfig the sequence ran with (policy, budget, sinks...)
    budget: int | None  # slots per head; None for the full cache
    tokens: np.ndarray  # (N,) int64: every token fed to the cache, position order
    length: int  # valid slots per head, the prefix [0, length)
    peak_bytes: int
    key: np.ndarray  # (L, Hkv, C, D) after RoPE
    value: np.ndarray  # (L, Hkv, C, D)
    position: np.ndarray  # (L, Hkv, C) int64, -1 = empty
    statistics: dict[str, np.ndarray]  # policy statistic -> (L, Hkv, C) float32
    policy_state: dict[str, Any]  # JSON description (kvpop.sessions.policy_state)
    policy_arrays: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def tokens_seen(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def nbytes(self) -> int:
        arrays = [self.tokens, self.key, self.value, self.position, *self.statistics.values(), *self.policy_arrays.values()]
        return sum(array.nbytes for array in arrays)

    def reusable_for(self, prompt_ids: list[int]) -> bool:
        """Whether a prompt continues this state: it starts with `tokens` and adds at least one."""
        count = self.tokens_seen
        return len(prompt_ids) > count and np.array_equal(np.asarray(prompt_ids[:count], np.int64), self.tokens)


def capture_state(cache: "SlotCache", tokens: list[int], fingerprint: str, cache_options: dict[str, Any]) -> SessionState:
    """A copy of `cache` (its arrays may be views into the batch pool) with the tokens it has seen."""
    if len(tokens) != cache.tokens_seen:
        raise ValueError(f"the cache has seen {cache.tokens_seen} tokens, the history has {len(tokens)}")
    description, policy_arrays = encode_policy_state(cache.policy_state)
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


def restore_cache(state: SessionState, spec: "ModelSpec", policy: "EvictionPolicy") -> "SlotCache":
    """A new slot cache continuing `state` (owns copies of every array: the state stays reusable)."""
    from kvpop.cache.slot_cache import SlotCache

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
    cache.policy_state = decode_policy_state(state.policy_state, state.policy_arrays)
    return cache
