"""How much prompt work an engine step may take while streams decode, sized from measured step times.

Why: a running stream's gap between two tokens is one decode step plus the prompt work that shares
the step. A fixed token budget (vLLM's max_num_batched_tokens) fits one model on one machine: 32
prompt tokens cost a tenth of a decode step on one and three decode steps on another. The pacer
instead aims the prompt work of a step at `ratio` times the measured decode step, so the longest gap
stays near (1 + ratio) times the usual one on any model and device. It is a feedback loop, not a cost
model: after each step's prompt work it scales the next step's tokens by how far that work's time
was from its target (square-rooted and at most 2x either way, so one noisy or short step moves it
little). A chunk cut into pieces
still enters its cache once (kvpop.kvtypes.StagedChunk), so pacing changes when tokens arrive, never
which tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

EMA_WEIGHT = 0.2  # weight of the newest decode step in the decode time's moving average


@dataclass
class PrefillPacer:
    ratio: float  # prompt work per step, in decode steps' time
    min_tokens: int = 8  # a step's prompt work never shrinks below this (progress on a slow machine)
    decode_seconds: float | None = None  # moving average of a decode step
    tokens: float | None = None  # the next step's prompt tokens; None: not yet measured (min_tokens)

    def __post_init__(self) -> None:
        if not self.ratio > 0 or self.min_tokens < 1:
            raise ValueError(f"pacing ratio must be > 0 and min_tokens >= 1, got {self.ratio}, {self.min_tokens}")

    def observe_decode(self, seconds: float) -> None:
        previous = self.decode_seconds
        self.decode_seconds = seconds if previous is None else (1 - EMA_WEIGHT) * previous + EMA_WEIGHT * seconds

    def observe_prefill(self, seconds: float, tokens: int) -> None:
        """A step's prompt work (run beside decodes) took `seconds` for `tokens` prompt tokens."""
        if self.decode_seconds is None or seconds <= 0 or tokens <= 0:
            return
        target = self.ratio * self.decode_seconds
        self.tokens = tokens * min(max(math.sqrt(target / seconds), 0.5), 2.0)

    def step_tokens(self, ceiling: int) -> int:
        """Prompt tokens the next step may feed beside its decodes (at most `ceiling`)."""
        if self.tokens is None:  # start small: the first prompt beside running streams stalls nobody
            self.tokens = self.min_tokens
        self.tokens = min(max(self.tokens, self.min_tokens), ceiling)  # the estimate never runs away
        return int(self.tokens)
