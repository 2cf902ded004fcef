"""Keep the start: the first B tokens stay, every later one is evicted (a prompt truncated to its beginning).

The floor for any policy that claims to remember: a conversation whose fact is told first is answered
from this cache as long as the fact fits in the budget, so a benchmark it passes does not test memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvpop.policies.base import EvictionPolicy


@dataclass
class KeepStartPolicy(EvictionPolicy):
    name = "keep_start"

    def score(self, cache, candidates) -> np.ndarray:
        return -candidates.positions.astype(np.float32)  # the newest token goes first
