"""The per-sequence KV slot cache: a dense [L, Hkv, C, D] store whose slots are overwritten in place.

Why dense slots and not a growing list: every head of a bounded sequence has the same budget B, so
the cache of one sequence is one fixed-size tensor and memory never grows with the tokens seen. Keys
are stored after RoPE, so a slot's index carries no meaning; `position` records where each slot's
token came from. Heads evict independently (different heads may keep different tokens), but every
head receives every new token, so the number of valid slots is the same for all heads and the valid
slots are always the prefix [0, length) -- a per-sequence mask is enough for attention.

Order of events when T new tokens arrive (`append`):
  1. the policy `observe`s the step and returns a `StatisticsUpdate`; the cache applies it (new values
     for the cached slots' statistics; the new tokens' statistics go in with them below);
  2. if the tokens fit (length + T <= limit), they are written after the valid prefix, growing the
     storage in blocks when needed (capacity grows lazily up to the budget);
  3. otherwise every head keeps the `limit` highest-priority of its C old + T new candidates, and the
     kept new tokens overwrite the slots of the dropped old ones.

The cache asks its storage owner (the batch pool, `SlotStorage`) one thing only: room to grow in place.
While it lives in a pool that mirrors to the device, it records which (layer, head, slot) entries it
wrote (`take_writes`) and the pool collects them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from kvpop.kvtypes import CacheUpdate, Candidates, StatisticsUpdate
from kvpop.model_spec import ModelSpec

if TYPE_CHECKING:
    from kvpop.policies.base import EvictionPolicy

GROWTH_BLOCK = 64  # slots added at a time while a cache fills up to its budget (or grows, unbounded)


def round_up_slots(slots: int) -> int:
    """The storage a cache takes for `slots` slots: whole growth blocks (admission reserves this)."""
    return -(-slots // GROWTH_BLOCK) * GROWTH_BLOCK


class SlotStorage(Protocol):
    """Arrays a cache's keys and values may live in besides its own (kvpop.cache.pool.BatchSlotPool)."""

    def grown_views(self, cache: "SlotCache", capacity: int) -> tuple[np.ndarray, np.ndarray] | None:
        """(key, value) views of `capacity` slots of the cache's row, if there is that room; else None."""


class SlotCache:
    """One sequence's keys, values and per-slot metadata under one eviction policy."""

    def __init__(
        self,
        spec: ModelSpec,
        policy: "EvictionPolicy",
        budget: int | None,
        initial_capacity: int = 0,
    ) -> None:
        if budget is not None and budget < 1:
            raise ValueError(f"budget must be at least 1 slot per head, got {budget}")
        self.spec = spec
        self.policy = policy
        self.budget = budget  # None: unbounded (the full cache)
        self.dtype = np.dtype(spec.dtype)
        self.length = 0  # valid slots per head (the prefix [0, length))
        self.tokens_seen = 0
        self.peak_bytes = 0
        self.storage_owner: "SlotStorage | None" = None  # the batch pool whose arrays `key`/`value` view
        self._writes: list | None = None  # index expressions written since `take_writes`; None: not tracked
        self.key = self._zeros_kv(0)  # (L, Hkv, C, D)
        self.value = self._zeros_kv(0)  # (L, Hkv, C, D)
        self.position = np.full(self._head_shape(0), -1, np.int64)  # (L, Hkv, C), -1 = empty
        self.statistics = {name: np.zeros(self._head_shape(0), np.float32) for name in policy.statistics}
        self.reserve(initial_capacity)
        self.policy_state: Any = policy.init_state()  # the policy's (or its scorer's) per-sequence state
        # What the policy made of the request's prompt (EvictionPolicy.prompt_state, set at allocation; not
        # saved with a session: a later turn sets its own; tokens scored before that keep their priority).
        self.prompt_state: Any = None

    # -- geometry and memory --------------------------------------------------------------------

    def _head_shape(self, slots: int) -> tuple[int, int, int]:
        return (self.spec.num_layers, self.spec.num_kv_heads, slots)

    def _zeros_kv(self, slots: int) -> np.ndarray:
        return np.zeros((*self._head_shape(slots), self.spec.head_dim), self.dtype)

    @property
    def capacity(self) -> int:
        return self.key.shape[2]

    @property
    def limit(self) -> float:
        return float("inf") if self.budget is None else self.budget

    @property
    def nbytes(self) -> int:
        """Bytes of the key and value storage this sequence holds (2 * L * Hkv * C * D * itemsize)."""
        return self.capacity * self.spec.kv_bytes_per_token

    @property
    def tokens_evicted(self) -> int:
        return self.tokens_seen - self.length

    def slot_mask(self) -> np.ndarray:  # (C,) bool
        return np.arange(self.capacity) < self.length

    def reserve(self, slots: int) -> None:
        """Make room for `slots` slots per head (never beyond the budget), growing in blocks: within
        the storage owner's row when it has room (no copy), else into arrays of its own."""
        slots = int(min(slots, self.limit))
        if slots <= self.capacity:
            return
        new_capacity = int(min(round_up_slots(slots), self.limit))
        in_place = self.storage_owner.grown_views(self, new_capacity) if self.storage_owner is not None else None
        if in_place is not None:  # the owner's row has room: the valid prefix is already there
            self.key, self.value = in_place
        else:
            key, value = self._zeros_kv(new_capacity), self._zeros_kv(new_capacity)
            key[:, :, : self.length] = self.key[:, :, : self.length]
            value[:, :, : self.length] = self.value[:, :, : self.length]
            self.key, self.value, self.storage_owner, self._writes = key, value, None, None
        self.position = self._grown(self.position, new_capacity, fill=-1)
        self.statistics = {name: self._grown(stat, new_capacity, fill=0) for name, stat in self.statistics.items()}
        self.peak_bytes = max(self.peak_bytes, self.nbytes)

    def _grown(self, array: np.ndarray, capacity: int, fill: float) -> np.ndarray:
        grown = np.full(self._head_shape(capacity), fill, array.dtype)
        grown[:, :, : self.length] = array[:, :, : self.length]
        return grown

    def rebind(self, key: np.ndarray, value: np.ndarray, owner: SlotStorage, track_writes: bool = False) -> None:
        """Move the keys and values into `owner`'s storage (views of shape (L, Hkv, C, D));
        `track_writes`: record what is written from now on (the owner mirrors it to a device)."""
        if key.shape != self.key.shape or value.shape != self.value.shape:
            raise ValueError(f"rebind needs views of shape {self.key.shape}, got {key.shape}")
        key[:, :, : self.length] = self.key[:, :, : self.length]
        value[:, :, : self.length] = self.value[:, :, : self.length]
        self.key, self.value, self.storage_owner = key, value, owner
        self._writes = [] if track_writes else None

    def take_writes(self) -> list:
        """Index expressions into (L, Hkv, C) written since the last call (empty when not tracked)."""
        if self._writes is None:
            return []
        writes, self._writes = self._writes, []
        return writes

    # -- writing tokens -------------------------------------------------------------------------

    def record_write(self, where) -> None:
        if self._writes is not None:
            self._writes.append(where)

    def append(
        self,
        key: np.ndarray,  # (L, Hkv, T, D)
        value: np.ndarray,  # (L, Hkv, T, D)
        attention: np.ndarray | None,  # (L, Hq, T, S) with S >= C; slots beyond C are padding
        chunk_attention: np.ndarray | None,  # (L, Hq, T, T)
        query_attention: np.ndarray | None = None,  # (L, Hq, W, C + T): a whole prompt's last W queries (CacheUpdate)
        prompt_attention: np.ndarray | None = None,  # (L, Hq, C + T): what all its queries put on each (CacheUpdate)
    ) -> None:
        """Store T new tokens, evicting per head with the policy when the budget is exceeded."""
        num_layers, num_kv_heads, new_tokens, _ = key.shape
        group = self.spec.query_heads_per_kv_head
        capacity = self.capacity
        if attention is None and prompt_attention is None and self.policy.needs_attention:
            raise ValueError(f"policy {self.policy.name!r} reads attention, but the step returned none")
        update = CacheUpdate(
            positions=np.arange(self.tokens_seen, self.tokens_seen + new_tokens, dtype=np.int64),
            key=key,
            value=value,
            attention=None if attention is None
            else attention[..., :capacity].reshape(num_layers, num_kv_heads, group, new_tokens, capacity),
            chunk_attention=None if chunk_attention is None
            else chunk_attention.reshape(num_layers, num_kv_heads, group, new_tokens, new_tokens),
            query_attention=None if query_attention is None
            else query_attention.reshape(num_layers, num_kv_heads, group, query_attention.shape[2], capacity + new_tokens),
            prompt_attention=None if prompt_attention is None
            else prompt_attention.reshape(num_layers, num_kv_heads, group, capacity + new_tokens),
        )
        decided: StatisticsUpdate = self.policy.observe(self, update)
        for name, values in decided.cached.items():  # (L, Hkv, C): the policy's arrays, taken over
            if values.shape != self.statistics[name].shape:
                raise ValueError(f"policy {self.policy.name!r} updated {name} with shape {values.shape}")
            self.statistics[name] = values
        new_statistics = decided.new
        self.tokens_seen += new_tokens
        if self.length + new_tokens <= self.limit:
            self._write_after_prefix(update, new_statistics)
        else:
            self.reserve(self.budget)
            self._write_evicting(update, new_statistics)

    def _write_after_prefix(self, update: CacheUpdate, new_statistics: dict[str, np.ndarray]) -> None:
        start, stop = self.length, self.length + update.num_tokens
        self.reserve(stop)
        self.key[:, :, start:stop] = update.key
        self.value[:, :, start:stop] = update.value
        self.record_write(np.s_[:, :, start:stop])
        self.position[:, :, start:stop] = update.positions
        for name, stat in self.statistics.items():
            stat[:, :, start:stop] = new_statistics[name]
        self.length = stop

    def _write_evicting(self, update: CacheUpdate, new_statistics: dict[str, np.ndarray]) -> None:
        capacity, new_tokens = self.capacity, update.num_tokens
        candidates = Candidates(
            positions=np.concatenate(
                [self.position, np.broadcast_to(update.positions, (*self._head_shape(0)[:2], new_tokens))], axis=2
            ),
            statistics={
                name: np.concatenate([stat, new_statistics[name]], axis=2) for name, stat in self.statistics.items()
            },
            tokens_seen=self.tokens_seen,
            capacity=capacity,
        )
        priority = self.policy.keep_priority(self, candidates)  # (L, Hkv, C + T)
        # Keep the `capacity` highest priorities per head; empty old slots always lose.
        priority = np.where(candidates.valid, priority, -np.inf)
        if new_tokens == 1:  # a decode step: each head drops one candidate, the new token or an old slot
            dropped_one = priority.argmin(axis=2)  # (L, Hkv); ties: the first slot (as decode_batch)
            layer, head = np.nonzero(dropped_one < capacity)  # heads that keep the new token
            slot = dropped_one[layer, head]
            self.key[layer, head, slot] = update.key[layer, head, 0]
            self.value[layer, head, slot] = update.value[layer, head, 0]
            self.record_write((layer, head, slot))
            self.position[layer, head, slot] = update.positions[0]
            for name, stat in self.statistics.items():
                stat[layer, head, slot] = new_statistics[name][layer, head, 0]
            self.length = capacity
            return
        dropped = np.argpartition(priority, new_tokens - 1, axis=2)[..., :new_tokens]  # (L, Hkv, T)
        keep = np.ones(priority.shape, bool)
        np.put_along_axis(keep, dropped, False, axis=2)
        # Pair each head's kept new tokens with its dropped old slots (equal counts), in index order.
        old_dropped, new_kept = ~keep[..., :capacity], keep[..., capacity:]
        pairs = min(capacity, new_tokens)
        slots = np.argsort(~old_dropped, axis=2, kind="stable")[..., :pairs]  # dropped old slots first
        tokens = np.argsort(~new_kept, axis=2, kind="stable")[..., :pairs]  # kept new tokens first
        used = np.arange(pairs) < new_kept.sum(axis=2, keepdims=True)  # (L, Hkv, pairs)
        layer, head, pair = np.nonzero(used)
        slot, token = slots[layer, head, pair], tokens[layer, head, pair]
        self.key[layer, head, slot] = update.key[layer, head, token]
        self.value[layer, head, slot] = update.value[layer, head, token]
        self.record_write((layer, head, slot))
        self.position[layer, head, slot] = update.positions[token]
        for name, stat in self.statistics.items():
            stat[layer, head, slot] = new_statistics[name][layer, head, token]
        self.length = capacity
