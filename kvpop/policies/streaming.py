"""StreamingLLM (Xiao et al., 2023, "Efficient Streaming Language Models with Attention Sinks").

Keeps the first `sinks` tokens and the most recent ones: everything else is evicted oldest first.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvpop.policies.base import EvictionPolicy


@dataclass
class StreamingPolicy(EvictionPolicy):
    name = "streaming"
    uses_sinks = True
    sinks: int = 4

    def __post_init__(self) -> None:
        if self.sinks < 0:
            raise ValueError(f"streaming: sinks must be >= 0, got {self.sinks}")

    def score(self, cache, candidates) -> np.ndarray:
        return candidates.positions.astype(np.float32)  # the oldest non-sink token goes first
