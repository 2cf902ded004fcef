"""`SessionState`: everything needed to continue a finished sequence exactly, detached from any engine.

A turn ends with the sequence's cache holding every token it was fed (the prompt and all outputs but
the last, which was sampled and never fed). The next turn's prompt must begin with exactly those
tokens (`tokens`); then only the rest is prefilled into a copy of the saved cache. Storing the token
history, not only the slots, is what makes reuse safe: a prompt that does not start with it (an
edited conversation, another client guessing the id) simply gets a cold prefill.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


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
    policy_state: dict[str, Any]  # JSON description (kvpop.policies.kvpop.state_codec)
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
