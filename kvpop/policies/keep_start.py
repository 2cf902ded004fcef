"""Keep the start: the prompt's first tokens and a protected recent window; everything between goes.

The floor for a document whose facts sit early (a system prompt, the opening of a pasted text): what a
truncating client keeps when it cuts the middle of a long prompt. StreamingLLM keeps 4 first tokens and
fills the rest with the most recent ones; this policy fills it with the earliest, newest first evicted
once it leaves the window.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvpop.policies.base import EvictionPolicy


@dataclass
class KeepStartPolicy(EvictionPolicy):
    name = "keep_start"
    uses_window = True
    window: int = 64

    def __post_init__(self) -> None:
        if self.window < 0:
            raise ValueError(f"keep_start: window must be >= 0, got {self.window}")

    def score(self, cache, candidates) -> np.ndarray:
        return -candidates.positions.astype(np.float32)  # outside the window, the latest token goes first
