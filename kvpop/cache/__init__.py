"""The fixed-budget KV slot cache of one sequence, and the pool that batches running sequences."""

from kvpop.cache.pool import BatchSlotPool
from kvpop.cache.slot_cache import GROWTH_BLOCK, SlotCache

__all__ = ["GROWTH_BLOCK", "BatchSlotPool", "SlotCache"]
