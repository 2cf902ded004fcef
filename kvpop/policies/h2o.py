"""H2O (Zhang et al., 2023, "H2O: Heavy-Hitter Oracle for Efficient Generative Inference").

Keeps the "heavy hitters": tokens with the largest attention accumulated over every query so far
(summed over the query heads of the GQA group), plus a protected recent window.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvpop.kvtypes import StatisticsUpdate
from kvpop.policies.base import EvictionPolicy, accumulate_attention


@dataclass
class H2OPolicy(EvictionPolicy):
    name = "h2o"
    statistics = ("accumulated_attention",)
    needs_attention = True
    uses_window = True
    window: int = 64

    def __post_init__(self) -> None:
        if self.window < 0:
            raise ValueError(f"h2o: window must be >= 0, got {self.window}")

    def observe(self, cache, update) -> StatisticsUpdate:
        return accumulate_attention(cache, update, "accumulated_attention")

    def score(self, cache, candidates) -> np.ndarray:
        return candidates.statistics["accumulated_attention"]
