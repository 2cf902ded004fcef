"""The scheduler's one waiting queue and its admission by KV memory (as vLLM's scheduler admits by free blocks).

A request is read once into a `Pending` around its `AdmissionPlan` (the cache manager's one reading of its
cache configuration: its policy built, its budget resolved, what its cache and its prefill take beside the
batch pool until its first token, whether it can ever fit). The cache manager owns the memory: it reserves
a plan's slots (`reserve`: the running sequences share one padded batch pool, kvpop.cache.reservations).
Requests are admitted first come first served, no overtaking. When a bounded request does not fit, it is
admitted at a smaller budget if that is still >= `min_kv_budget` (degradation: its plan is replaced by one
at that budget, which records the budget asked for, reported in its result); otherwise it waits, and past
`max_queue_size` requests waiting for memory the next is refused as overloaded. Each sequence is reserved
at its worst case (its budget, or prompt + max_tokens for the full cache), so the engine cannot outgrow
the pool however many requests arrive. A reserved request waits for a place in the running batch
(`max_batch_size`).

Repacking the batch pool (when sequences join or leave) briefly holds the old and the new pool arrays
together: give the instance that much headroom beyond its KV pool.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator

from kvpop.cache.reservations import AdmissionPlan, storage_slots
from kvpop.cache.slot_cache import GROWTH_BLOCK
from kvpop.request import GenerationRequest

if TYPE_CHECKING:
    from kvpop.cache.manager import CacheManager
    from kvpop.cache.slot_cache import SlotCache


class OverloadedError(RuntimeError):
    """Too many requests wait for KV memory: the client should retry later."""


@dataclass(frozen=True)
class AdmissionPolicy:
    min_kv_budget: int | None = None  # a tight pool may degrade a bounded request down to this; None: never
    max_queue_size: int | None = None  # requests allowed to wait for KV memory; more are overloaded (None: no limit)

    def __post_init__(self) -> None:
        if (self.min_kv_budget is not None and self.min_kv_budget <= 0) or (self.max_queue_size is not None and self.max_queue_size < 0):
            raise ValueError(f"invalid admission policy {self}")


@dataclass
class Pending:
    """A request as the scheduler reads it once: its plan, and its admission."""

    request: GenerationRequest
    plan: AdmissionPlan  # a degraded request's at its reduced budget
    prefilled: "tuple[SlotCache, int] | None" = None  # a cache holding its whole prompt, and its first token
    reserved: bool = False  # its KV memory is reserved: it waits only for a place in the running batch

    @property
    def request_id(self) -> str:
        return self.request.request_id


class WaitingQueue:
    """The requests not yet running, in arrival order: those with their memory reserved come first."""

    def __init__(self, manager: "CacheManager", policy: AdmissionPolicy) -> None:
        self.manager = manager
        self.policy = policy
        self._queue: deque[Pending] = deque()

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Pending]:
        return iter(self._queue)

    @property
    def waiting_for_memory(self) -> int:
        return sum(not pending.reserved for pending in self._queue)

    @staticmethod
    def check_fits(pending: Pending) -> None:
        """ValueError unless the request could ever run here (alone, degraded if allowed: its plan says)."""
        if not pending.plan.fits:
            raise ValueError(f"request needs {pending.plan.storage_slots} KV slots per head, more than this instance's KV pool "
                             f"holds; lower max_tokens or choose a bounded eviction_policy")

    def add(self, pending: Pending) -> None:
        """Queue a request, its memory reserved now if none waits for memory ahead of it and it fits.
        OverloadedError when `max_queue_size` requests already wait for memory."""
        waiting = self.waiting_for_memory
        if not waiting and self.reserve(pending):
            self._queue.append(pending)
            return
        if self.policy.max_queue_size is not None and waiting >= self.policy.max_queue_size:
            raise OverloadedError(f"overloaded: {waiting} requests already waiting for KV memory; retry later")
        self._queue.append(pending)

    def admit(self) -> None:
        """Reserve memory for the requests waiting for it, in order, until one does not fit."""
        for pending in self._queue:
            if not pending.reserved and not self.reserve(pending):
                return

    def take(self, room: int) -> list[Pending]:
        """Up to `room` reserved requests from the front, to join the running batch."""
        taken = []
        while self._queue and len(taken) < room and self._queue[0].reserved:
            taken.append(self._queue.popleft())
        return taken

    def remove(self, request_ids: set[str]) -> list[Pending]:
        """Take these requests out of the queue (cancelled), their reservations released."""
        removed = [pending for pending in self._queue if pending.request_id in request_ids]
        self._queue = deque(pending for pending in self._queue if pending.request_id not in request_ids)
        for pending in removed:
            self.manager.release(pending.request_id)
        return removed

    def reserve(self, pending: Pending) -> bool:
        """Reserve the request's memory, at a smaller budget down to `min_kv_budget` if need be (its plan
        then degraded: the budget it asked for is recorded, and reported in its result)."""
        plan = pending.plan
        if self.manager.reserve(pending.request_id, plan.storage_slots, plan.prefill_slots) is not None:
            pending.reserved = True
            return True
        if plan.budget is None or self.policy.min_kv_budget is None:
            return False
        budget = (min(plan.budget, plan.storage_slots) // GROWTH_BLOCK) * GROWTH_BLOCK
        while budget >= max(self.policy.min_kv_budget, 1):
            slots = storage_slots(budget, plan.prompt_tokens, plan.max_tokens)
            if self.manager.reserve(pending.request_id, slots, plan.prefill_slots) is not None:
                pending.plan, pending.reserved = plan.degraded(budget), True
                return True
            budget -= GROWTH_BLOCK
        return False
