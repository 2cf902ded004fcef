"""Full cache: keeps every token (the quality reference); the cache grows with the sequence."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvpop.policies.base import EvictionPolicy


@dataclass
class FullPolicy(EvictionPolicy):
    name = "full"
    evicts = False

    def score(self, cache, candidates) -> np.ndarray:
        raise RuntimeError("the full cache is unbounded and never evicts; give it budget=None")
