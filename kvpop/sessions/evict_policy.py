"""Which session leaves a tier first: one `get_priority` per strategy, the lowest leaves (as SGLang's
`mem_cache/evict_policy.py`). Sessions move down one tier at a time, so the order also decides which
ones reach the disk first."""

from __future__ import annotations

from typing import Protocol


class TierEntry(Protocol):
    last_access: int  # the store's access counter when the entry was last read or written
    hits: int


class LRUPolicy:
    """Least recently used first: a conversation idle the longest is the least likely to go on."""

    def get_priority(self, entry: TierEntry) -> int:
        return entry.last_access


class LFUPolicy:
    """Least frequently used first, the older one among equals."""

    def get_priority(self, entry: TierEntry) -> tuple[int, int]:
        return (entry.hits, entry.last_access)
