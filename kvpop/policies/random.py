"""Random eviction: the floor every informed policy must beat. Seeded, so runs are reproducible."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvpop.policies.base import EvictionPolicy


@dataclass
class RandomPolicy(EvictionPolicy):
    name = "random"
    seed: int = 0

    def init_state(self) -> np.random.Generator:
        return np.random.default_rng(self.seed)  # one stream per sequence

    def score(self, cache, candidates) -> np.ndarray:
        return cache.policy_state.random(candidates.positions.shape, dtype=np.float32)
