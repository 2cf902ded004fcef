"""Token sampling: greedy, temperature, top-k and top-p, reproducible per request.

Each request owns its random generator, seeded from its own seed, so a seeded request draws the
same tokens whether it runs alone or batched with others.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


MAX_TEMPERATURE = 100.0  # beyond this sampling is uniform noise; also refuses inf and nan


@dataclass
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy (argmax)
    top_p: float = 1.0  # nucleus: smallest set of tokens whose probability reaches top_p
    top_k: int = 0  # 0 = no top-k cut
    seed: int | None = None  # None: fresh entropy per request
    max_tokens: int = 64  # generated tokens, including a final EOS
    stop: tuple[str, ...] = ()  # stop when the generated text contains one of these
    ignore_eos: bool = False  # keep going past EOS (benchmarks that need a fixed length)

    def __post_init__(self) -> None:
        if not 0.0 <= self.temperature <= MAX_TEMPERATURE:
            raise ValueError(f"temperature must be in [0, {MAX_TEMPERATURE:g}] (0 = greedy), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = disabled), got {self.top_k}")
        if self.seed is not None and not 0 <= self.seed < 2**64:
            raise ValueError(f"seed must be in [0, 2**64), got {self.seed}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if isinstance(self.stop, str):
            self.stop = (self.stop,)
        self.stop = tuple(self.stop)
        if any(not isinstance(text, str) or not text for text in self.stop):
            raise ValueError(f"stop strings must be non-empty strings, got {self.stop!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class Sampler:
    """Draws the next token from one step's logits for one request."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.rng = np.random.default_rng(params.seed)

    def __call__(self, logits: np.ndarray) -> int:  # logits: (V,)
        params = self.params
        if params.greedy:
            return int(np.argmax(logits))
        scaled = logits.astype(np.float64) / params.temperature
        if params.top_k and params.top_k < scaled.size:
            kth_largest = np.partition(scaled, -params.top_k)[-params.top_k]
            scaled = np.where(scaled < kth_largest, -np.inf, scaled)
        probs = np.exp(scaled - scaled.max())
        probs /= probs.sum()
        if params.top_p < 1.0:
            order = np.argsort(-probs, kind="stable")
            cumulative = np.cumsum(probs[order])
            cut = int(np.searchsorted(cumulative, params.top_p)) + 1  # keep through the token reaching top_p
            keep = np.zeros_like(probs, dtype=bool)
            keep[order[:cut]] = True
            probs = np.where(keep, probs, 0.0)
            probs /= probs.sum()
        return int(self.rng.choice(probs.size, p=probs))
