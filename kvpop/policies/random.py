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

    def encode_state(self, state):
        if isinstance(state, np.random.Generator):  # the generator's position: a session continues the stream
            return {"kind": "numpy_generator", "bit_generator": state.bit_generator.state}, {}
        return super().encode_state(state)

    def decode_state(self, description, arrays):
        if description.get("kind") != "numpy_generator":
            return super().decode_state(description, arrays)
        bit_state = description["bit_generator"]
        generator = np.random.Generator(getattr(np.random, bit_state["bit_generator"])())
        generator.bit_generator.state = bit_state
        return generator

    def score(self, cache, candidates) -> np.ndarray:
        return cache.policy_state.random(candidates.positions.shape, dtype=np.float32)
