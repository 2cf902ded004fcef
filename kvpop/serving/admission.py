"""Admission by KV memory: every bounded sequence's cache size is known before it starts.

The cache manager owns the instance's KV memory and sizes what each request needs
(`CacheManager.reserve`, `kvpop.cache.reservations`: the running sequences share one padded batch
pool, and a whole-prompt prefill holds its prompt beside it until its first token). This module is
the policy around it: a request is admitted when the manager grants its reservation. When it does not
fit, a bounded request is admitted at a smaller budget if that is still >= the configured floor
(graceful degradation, reported back); otherwise it waits in a FIFO queue, and past the queue limit
it is rejected as overloaded. Each sequence is reserved at its worst case (full budget, or prompt +
max_tokens for the full cache), so the engine cannot outgrow the pool however many requests arrive.

Repacking the batch pool (when sequences join or leave) briefly holds the old and the new pool arrays
together: give the instance that much headroom beyond kv_pool_mb.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from kvpop.cache import GROWTH_BLOCK
from kvpop.request import GenerationRequest

if TYPE_CHECKING:
    from kvpop.cache.manager import CacheManager


class OverloadedError(RuntimeError):
    """The queue is full: the client should retry later."""


@dataclass(frozen=True)
class AdmissionPolicy:
    min_kv_budget: int  # never degrade a request below this many slots per head
    max_queue_size: int  # requests allowed to wait; more are rejected as overloaded

    def __post_init__(self) -> None:
        if self.min_kv_budget <= 0 or self.max_queue_size < 0:
            raise ValueError(f"invalid admission policy {self}")


@dataclass(frozen=True)
class Admission:
    request: GenerationRequest  # possibly with a reduced budget
    slots: int  # slots per head reserved
    degraded_from: int | None = None  # the budget asked for, when it was reduced


class KVPoolAdmission:
    """Whether, and at which budget, a request gets KV memory from the cache manager now."""

    def __init__(self, policy: AdmissionPolicy) -> None:
        self.policy = policy

    def fits_when_idle(self, manager: "CacheManager", request: GenerationRequest) -> bool:
        """Whether the request could ever run here (alone, degraded if allowed)."""
        if request.cache.policy == "full":
            return manager.holds_alone(request)
        return manager.holds_alone(request) or manager.holds_alone(request, self.policy.min_kv_budget)

    def try_admit(self, manager: "CacheManager", request: GenerationRequest, prefill_slots: int = 0) -> Admission | None:
        """Reserve memory for `request` now, degrading its budget if needed; None if it must wait.
        `prefill_slots`: what its prefill holds beyond its cache until its first token
        (`CacheManager.prefill_slots`), reserved until `CacheManager.prefill_done`."""
        reservation = manager.reserve(request, prefill_slots)
        if reservation is not None:
            return Admission(request, reservation.slots)
        if request.cache.policy == "full":
            return None
        asked = request.cache.resolve_budget(len(request.prompt_ids), request.sampling.max_tokens)
        budget = (min(asked, manager.slots_needed(request)) // GROWTH_BLOCK) * GROWTH_BLOCK
        while budget >= max(self.policy.min_kv_budget, 1):
            reservation = manager.reserve(request, prefill_slots, budget)
            if reservation is not None:
                degraded = replace(request, cache=replace(request.cache, budget=budget, compression=None))
                return Admission(degraded, reservation.slots, degraded_from=asked)
            budget -= GROWTH_BLOCK
        return None
