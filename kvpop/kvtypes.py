"""The data that passes between the slot cache, the policies and the engine: a leaf (numpy only).

`CacheUpdate` (new tokens arriving in one cache), `Candidates` (what an over-budget append chooses
from), `StatisticsUpdate` (what a policy concluded, which the cache applies), `StagedChunk` (a prompt
chunk computed in pieces) and `CacheView` (the read-only face of a slot cache that policies receive).
Policies and the cache both import these; neither imports the other's module for them.

`StagedChunk`: a prompt chunk computed in pieces over several engine steps, entering its cache once,
whole. Why: a running stream waits, between two of its tokens, for whatever prompt work shares the
engine step. vLLM bounds that with a per-step token budget; a bounded cache cannot simply take smaller
chunks, because a chunk is also where it evicts, so its answers would then depend on the load. Here a
chunk keeps its size and its one eviction; only its compute is split. Each piece's queries see the
cache (unchanged until the chunk is complete) plus the chunk's earlier pieces, which the decoder gets
as extra past slots, so every query attends to exactly what it would in one call. The pieces' keys,
values and attention rows are kept here; when the chunk is complete they are appended to the cache as
the one-call chunk's would be (tests/engine/test_scheduling.py compares them, for every policy).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np


@dataclass
class CacheUpdate:
    """T new tokens arriving in one sequence's cache, as the decoder step produced them."""

    positions: np.ndarray  # (T,) int64 original positions of the new tokens
    key: np.ndarray  # (L, Hkv, T, D), RoPE applied
    value: np.ndarray  # (L, Hkv, T, D)
    # None when the step returned no attention (policies with needs_attention False never read it)
    attention: np.ndarray | None  # (L, Hkv, G, T, C): new queries on the cache's C slots (grouped by KV head)
    chunk_attention: np.ndarray | None  # (L, Hkv, G, T, T): new queries on the new tokens (causal)
    # A whole prompt's last W queries (the question, for a policy with a `query_window`) on the cache's C
    # slots, then on the T new tokens: (L, Hkv, G, W, C + T); None for every other append.
    query_attention: np.ndarray | None = None
    # A whole prompt entering at once, with what EVERY one of its queries put on each old slot and new token
    # (summed over the queries; attention and chunk_attention are then None): (L, Hkv, G, C + T). The quality
    # harness supplies it (kvpop_eval.quality.prefill_once), so policies that accumulate attention score the
    # whole prompt, as a policy that reads the question does; None for every other append.
    prompt_attention: np.ndarray | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.positions)


@dataclass
class Candidates:
    """The C old slots followed by the T new tokens of one append, with what a policy scores them by."""

    positions: np.ndarray  # (L, Hkv, C + T) int64, -1 where an old slot is empty
    statistics: dict[str, np.ndarray]  # name -> (L, Hkv, C + T) float32
    tokens_seen: int  # after the append
    capacity: int  # C

    @property
    def valid(self) -> np.ndarray:  # (L, Hkv, C + T) bool
        return self.positions >= 0


@dataclass
class StatisticsUpdate:
    """What a policy concluded from one append; the slot cache applies it (the cache takes over the
    arrays: a policy returns fresh ones, never views of the cache's own statistics)."""

    new: dict[str, np.ndarray] = field(default_factory=dict)  # name -> (L, Hkv, T): every statistic, for the new tokens
    cached: dict[str, np.ndarray] = field(default_factory=dict)  # name -> (L, Hkv, C): new values of the cached slots; absent: unchanged


class BatchRows(Protocol):
    """The batch pool's arrays, whose rows the decoding caches view (kvpop.cache.pool.BatchSlotPool)."""

    key: np.ndarray  # (L, B, Hkv, S, D)
    value: np.ndarray  # (L, B, Hkv, S, D)
    track_writes: bool  # a device mirror exists: caches record the slots they write


class CacheView(Protocol):
    """What a policy reads of one sequence's slot cache (kvpop.cache.slot_cache.SlotCache); it writes
    nothing there but its own `policy_state` (and a policy's `prompt_state`), through its return values."""

    budget: int | None  # slots per head; None: unbounded
    length: int  # valid slots per head, the prefix [0, length)
    tokens_seen: int
    key: np.ndarray  # (L, Hkv, C, D)
    value: np.ndarray  # (L, Hkv, C, D)
    position: np.ndarray  # (L, Hkv, C) int64, -1 = empty
    statistics: dict[str, np.ndarray]  # name -> (L, Hkv, C) float32
    policy_state: Any  # the policy's per-sequence state (EvictionPolicy.init_state)
    prompt_state: Any  # what the policy made of the request's prompt (EvictionPolicy.prompt_state), if anything

    @property
    def capacity(self) -> int: ...

    @property
    def tokens_evicted(self) -> int: ...


@dataclass
class StagedChunk:
    """The computed first `length` tokens of one sequence's current prompt chunk."""

    capacity: int  # C: the cache's slots when the chunk began (the cache does not change until it ends)
    key: np.ndarray  # (L, Hkv, s, D), RoPE applied
    value: np.ndarray  # (L, Hkv, s, D)
    attention: np.ndarray | None  # (L, Hq, s, C): the pieces' queries on the cache's slots; None: no policy reads it
    chunk_attention: np.ndarray | None  # (L, Hq, s, s): on the chunk's own tokens (causal)

    @property
    def length(self) -> int:
        return self.key.shape[2]

    def query_attention(
        self, attention: np.ndarray, chunk_attention: np.ndarray  # (L, Hq, t, S >= C + s - t), (L, Hq, t, t): the last piece's
    ) -> np.ndarray:
        """(L, Hq, t, C + s): the chunk's last piece's t queries on the cache's C slots and on the whole
        chunk (s tokens, that piece included), what `CacheUpdate.query_attention` holds once grouped."""
        before = self.capacity + self.length - chunk_attention.shape[-1]  # slots the piece's call had as past
        return np.concatenate([attention[..., :before], chunk_attention], axis=-1)

    @property
    def nbytes(self) -> int:
        return self.key.nbytes + self.value.nbytes

    @classmethod
    def first(
        cls,
        capacity: int,
        new_key: np.ndarray,  # (L, Hkv, t, D): the first piece
        new_value: np.ndarray,
        attention: np.ndarray | None,  # (L, Hq, t, S >= C)
        chunk_attention: np.ndarray | None,  # (L, Hq, t, t)
    ) -> "StagedChunk":
        return cls(capacity, new_key.copy(), new_value.copy(),
                   None if attention is None else attention[..., :capacity].copy(),
                   None if chunk_attention is None else chunk_attention.copy())

    def add(
        self,
        new_key: np.ndarray,  # (L, Hkv, t, D): the next piece
        new_value: np.ndarray,
        attention: np.ndarray | None,  # (L, Hq, t, S >= C + s): on the cache's C slots, then the s staged tokens
        chunk_attention: np.ndarray | None,  # (L, Hq, t, t)
    ) -> None:
        """Take in the next piece, whose call had the staged tokens after the cache's slots."""
        capacity, staged, piece = self.capacity, self.length, new_key.shape[2]
        self.key = np.concatenate([self.key, new_key], axis=2)
        self.value = np.concatenate([self.value, new_value], axis=2)
        if self.attention is None or attention is None:  # a call without attention: no policy here reads it
            self.attention = self.chunk_attention = None
            return
        self.attention = np.concatenate([self.attention, attention[..., :capacity]], axis=2)  # (L, Hq, s + t, C)
        num_layers, num_query_heads = attention.shape[:2]
        grown = np.zeros((num_layers, num_query_heads, staged + piece, staged + piece), np.float32)
        grown[:, :, :staged, :staged] = self.chunk_attention  # earlier rows never see later tokens
        grown[:, :, staged:, :staged] = attention[..., capacity : capacity + staged]
        grown[:, :, staged:, staged:] = chunk_attention
        self.chunk_attention = grown
