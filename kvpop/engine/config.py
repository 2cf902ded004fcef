"""The engine's configuration: one dataclass, validated when made."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineConfig:
    """How an engine batches and schedules; what it runs (decoder, scorers, stores) is passed beside it.

    `max_step_tokens`: prompt tokens fed per step while streams decode (None: one `prefill_chunk`; a
    chunk longer than what is left is computed in pieces over several steps): the longest a running
    stream waits for prefill work between two tokens.
    `min_bounded_chunk`: a bounded cache's prompt chunks hold max(budget, this) tokens (at most
    `prefill_chunk`), so a small budget does not prefill a prompt in many small calls.
    `whole_prompt_tokens`: a bounded cache whose policy reads no attention takes a prompt of up to this
    many tokens (the part not already in its cache) as ONE chunk: prefilled with full attention,
    evicted once after it (compress after prefill, as kvpress does), holding the prompt's keys and
    values meanwhile. Evicting while prefilling changes the keys and values of everything after the
    first eviction, and costs the learned scorer most of its answers at 75-88% (docs/QUALITY.md).
    0, longer prompts, and policies that read attention (whose rows would be prompt x prompt) evict as
    they prefill.
    `prefill_pacing`: while streams decode, size each step's prompt work to about this many decode
    steps' time, measured as the engine runs (kvpop.engine.prefill_pacer; `max_step_tokens` stays the
    ceiling); None: the token budget alone.
    `min_kv_budget`, `max_queue_size`: admission by KV memory (kvpop.engine.admission): a tight pool may
    degrade a bounded request's budget down to `min_kv_budget` (None: never), and refuses a request as
    overloaded when `max_queue_size` already wait for memory (None: no limit).
    """

    max_batch_size: int = 8  # sequences admitted at once (decoding or prefilling)
    prefill_chunk: int = 256  # prompt tokens per prefill chunk (a bounded cache: see min_bounded_chunk)
    max_step_tokens: int | None = None
    min_bounded_chunk: int = 1
    whole_prompt_tokens: int = 0
    prefill_pacing: float | None = None
    min_kv_budget: int | None = None
    max_queue_size: int | None = None

    def __post_init__(self) -> None:
        if (self.max_batch_size < 1 or self.prefill_chunk < 1 or self.step_tokens < 1 or self.min_bounded_chunk < 1
                or self.whole_prompt_tokens < 0):
            raise ValueError(
                f"max_batch_size, prefill_chunk, max_step_tokens and min_bounded_chunk must be >= 1 and "
                f"whole_prompt_tokens >= 0, got {self.max_batch_size}, {self.prefill_chunk}, {self.max_step_tokens}, "
                f"{self.min_bounded_chunk}, {self.whole_prompt_tokens}"
            )

    @property
    def step_tokens(self) -> int:
        """Prompt tokens per step while streams decode (`max_step_tokens`, default one chunk)."""
        return self.prefill_chunk if self.max_step_tokens is None else self.max_step_tokens
