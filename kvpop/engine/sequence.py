"""One admitted request as the engine runs it, and the read-only view of it that callers get."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING

from kvpop.engine.detokenizer import IncrementalDetokenizer
from kvpop.request import NO_TOKEN, GenerationRequest
from kvpop.sampling import Sampler

if TYPE_CHECKING:
    from kvpop.cache.manager import Allocation
    from kvpop.cache.slot_cache import SlotCache


class Phase(StrEnum):
    WAITING = "waiting"  # queued, not admitted
    PREFILLING = "prefilling"  # admitted, prompt partly fed
    DECODING = "decoding"  # prompt in, generating


@dataclass
class Sequence:
    request: GenerationRequest
    allocation: "Allocation"  # the cache the manager gave it, and how much of the prompt that held
    sampler: Sampler
    output_ids: list[int] = field(default_factory=list)
    detokenizer: IncrementalDetokenizer | None = None  # its text and stop strings (an engine with a tokenizer)
    pending_token: int = NO_TOKEN  # sampled, not yet fed to the model
    prefilled: int = 0  # prompt tokens run through the model so far (in the cache, or staged)
    chunk_size: int = 1  # prompt tokens per prefill chunk (what enters the cache at once)
    staged_tokens: int = 0  # of the current chunk, computed but not yet in the cache (the manager holds them)
    query_window: int = 0  # > 0: the prompt's last this many tokens run as their own piece, with attention

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def cache(self) -> "SlotCache":
        return self.allocation.cache

    @property
    def prompt_left(self) -> int:
        return len(self.request.prompt_ids) - self.prefilled

    @property
    def chunk_left(self) -> int:
        """Prompt tokens left in the current chunk (a chunk begins as min(chunk_size, prompt left))."""
        return min(self.chunk_size, self.prompt_left + self.staged_tokens) - self.staged_tokens

    @property
    def piece_left(self) -> int:
        """Prompt tokens until the next piece must end: the chunk's end, or, before a `query_window`, the
        window's start (the policy reads the attention of those last queries alone)."""
        if self.query_window and self.chunk_left > self.query_window:
            return self.chunk_left - self.query_window
        return self.chunk_left

    @property
    def reads_query(self) -> bool:
        """Whether the next piece is the prompt's last `query_window` tokens, whose call returns attention."""
        return bool(self.query_window) and self.chunk_left <= self.query_window

    def view(self, phase: Phase) -> "SequenceState":
        return SequenceState(self.request_id, phase, self.prefilled, len(self.output_ids), self.chunk_size, self.allocation,
                             self.pending_token, self.staged_tokens)


@dataclass(frozen=True)
class SequenceState:
    """What an engine's caller may see of a sequence: its progress and its cache (to read, never to write)."""

    request_id: str
    phase: Phase
    prefilled: int  # prompt tokens run through the model (in the cache, or staged)
    output_tokens: int
    chunk_size: int  # prompt tokens per prefill chunk
    allocation: "Allocation"  # its cache, and how much of its prompt was reused
    next_token: int  # sampled, not yet fed to the model (NO_TOKEN: none yet)
    staged_tokens: int  # of its current prompt chunk, computed but not yet in its cache

    @property
    def cache(self) -> "SlotCache":
        return self.allocation.cache


@dataclass(frozen=True)
class EngineState:
    """Request ids by phase, at the moment it was taken."""

    waiting: tuple[str, ...]
    prefilling: tuple[str, ...]  # first come first served
    decoding: tuple[str, ...]
