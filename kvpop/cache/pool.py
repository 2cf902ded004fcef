"""The running sequences' caches stacked the way the decoder step takes them.

Why a pool instead of stacking every step: the decoder wants (L, B, Hkv, S, D). Stacking the
per-sequence caches before each decode step would copy every cache every token. Instead each
running sequence's `key`/`value` are views into one row of the pool's arrays, so a steady-state
decode step copies nothing: the decoder reads the pool and the slot cache writes new tokens into
its row in place. The pool is repacked (one copy of everything) only when the set of sequences
changes or a sequence outgrows the pool's slot count S; sequences with fewer slots than S are
padded and masked.
"""

from __future__ import annotations

import numpy as np

from kvpop.cache.slot_cache import SlotCache
from kvpop.model_spec import ModelSpec


class BatchSlotPool:
    def __init__(self, spec: ModelSpec) -> None:
        self.spec = spec
        self.dtype = np.dtype(spec.dtype)
        self._rows: dict[int, int] = {}  # id() of each bound cache -> its row, in row order
        self.key = self._zeros(0, 0)  # (L, B, Hkv, S, D)
        self.value = self._zeros(0, 0)
        self.dirty = np.zeros((0, 0, 0, 0), bool)  # (L, B, Hkv, S): slots written since `take_dirty`
        self.track_writes = False  # set by a device mirror; without one, writes cost no bookkeeping
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
        unchanged = [id(cache) for cache in caches] == list(self._rows) and all(
            cache.storage_owner is self and cache.capacity <= self.slots for cache in caches
        )
        if unchanged:
            return
        slots = max((cache.capacity for cache in caches), default=0)
        key, value = self._zeros(len(caches), slots), self._zeros(len(caches), slots)
        for row, cache in enumerate(caches):
            cache.rebind(key[:, row, :, : cache.capacity], value[:, row, :, : cache.capacity], owner=self)
        self.key, self.value = key, value
        self._rows = {id(cache): row for row, cache in enumerate(caches)}
        self.dirty = np.zeros(key.shape[:-1], bool)
        self.repacks += 1

    def written(self, cache: SlotCache, where) -> None:
        """A bound cache wrote the (layer, head, slot) entries `where` of its view: mark them dirty."""
        row = self._rows.get(id(cache)) if self.track_writes else None
        if row is not None:  # a cache dropped at the last repack writes only into its old view
            self.dirty[:, row][where] = True

    def take_dirty(self) -> np.ndarray:
        """(L, B, Hkv, S) slots written since the last call, and reset."""
        dirty, self.dirty = self.dirty, np.zeros_like(self.dirty)
        return dirty

    def slot_mask(self, caches: list[SlotCache]) -> np.ndarray:  # (B, S) bool
        return np.arange(self.slots)[None, :] < np.array([cache.length for cache in caches])[:, None]

    def release(self) -> None:
        self.bind([])
