"""The running sequences' caches stacked the way the decoder step takes them.

Why a pool instead of stacking every step: the decoder wants (L, B, Hkv, S, D). Stacking the
per-sequence caches before each decode step would copy every cache every token. Instead each
running sequence's `key`/`value` are views into one row of the pool's arrays, so a steady-state
decode step copies nothing: the decoder reads the pool and the slot cache writes new tokens into
its row in place. The pool is repacked (one copy of everything) only when the set of sequences
changes or a sequence outgrows the pool's slot count S (a growing cache grows in place within its
row while S has room, and a repack for growing caches leaves some); sequences with fewer slots than
S are padded and masked. With `track_writes` (a device mirror exists) the bound caches record the slots
they write, and `take_dirty` collects them into one (L, B, Hkv, S) mask.
"""

from __future__ import annotations

import numpy as np

from kvpop.cache.slot_cache import GROWTH_BLOCK, SlotCache, round_up_slots
from kvpop.model_spec import ModelSpec

# A repack for caches that grow (the full cache) leaves this much more room than the largest needs
# (at least one growth block), so they grow in place for a while: without it, eight full caches
# crossing their 64-slot block boundaries at different steps repacked the whole pool eight times per
# 64 tokens (a quarter of SmolLM2's decode time at 512 + 1024 tokens). The price: attention over at
# most this fraction of padding slots, which are masked.
GROWTH_HEADROOM = 0.125


def padded_bytes(slot_counts: list[int], bytes_per_slot: int) -> int:
    """Bytes of a pool holding caches of these sizes (slots per head): every row padded to the largest."""
    return len(slot_counts) * max(slot_counts, default=0) * bytes_per_slot


class BatchSlotPool:
    def __init__(self, spec: ModelSpec, track_writes: bool = False) -> None:
        self.spec = spec
        self.dtype = np.dtype(spec.dtype)
        self._caches: list[SlotCache] = []  # the bound caches, in row order
        self.key = self._zeros(0, 0)  # (L, B, Hkv, S, D)
        self.value = self._zeros(0, 0)
        self.track_writes = track_writes  # for a device mirror; without one, writes cost no bookkeeping
        self.repacks = 0  # a device mirror re-uploads everything when this changes

    def _zeros(self, batch: int, slots: int) -> np.ndarray:
        spec = self.spec
        return np.zeros((spec.num_layers, batch, spec.num_kv_heads, slots, spec.head_dim), self.dtype)

    @property
    def slots(self) -> int:
        return self.key.shape[3]

    @property
    def nbytes(self) -> int:
        return self.key.nbytes + self.value.nbytes

    def bind(self, caches: list[SlotCache]) -> None:
        """Make row r of the pool hold caches[r]; copies only when membership or sizes changed."""
        unchanged = len(caches) == len(self._caches) and all(
            cache is bound and cache.storage_owner is self and cache.capacity <= self.slots
            for cache, bound in zip(caches, self._caches)
        )
        if unchanged:
            return
        slots = max((cache.capacity for cache in caches), default=0)
        if any(cache.budget is None for cache in caches):  # growing caches: room to grow in place
            slots = round_up_slots(slots + max(GROWTH_BLOCK, int(slots * GROWTH_HEADROOM)))
        key, value = self._zeros(len(caches), slots), self._zeros(len(caches), slots)
        for row, cache in enumerate(caches):
            cache.rebind(key[:, row, :, : cache.capacity], value[:, row, :, : cache.capacity], self, self.track_writes)
        self.key, self.value = key, value
        self._caches = list(caches)
        self.repacks += 1

    def grown_views(self, cache: SlotCache, capacity: int) -> tuple[np.ndarray, np.ndarray] | None:
        """(key, value) views of `capacity` slots of `cache`'s row, if the pool has that room: a bound
        cache grows in place, and the next `bind` has nothing to copy. None: it must move out (no room,
        or it is no longer bound: its views point into arrays a repack replaced)."""
        row = next((row for row, bound in enumerate(self._caches) if bound is cache), None)
        if row is None or capacity > self.slots:
            return None
        return self.key[:, row, :, :capacity], self.value[:, row, :, :capacity]

    def take_dirty(self) -> np.ndarray:
        """(L, B, Hkv, S) slots the bound caches wrote since the last call (or the last repack)."""
        dirty = np.zeros(self.key.shape[:-1], bool)
        for row, cache in enumerate(self._caches):
            view = dirty[:, row]  # (L, Hkv, S)
            for where in cache.take_writes():
                view[where] = True
        return dirty

    def slot_mask(self, caches: list[SlotCache]) -> np.ndarray:  # (B, S) bool
        return np.arange(self.slots)[None, :] < np.array([cache.length for cache in caches])[:, None]

    def release(self) -> None:
        self.bind([])
