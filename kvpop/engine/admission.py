"""The engine's one waiting queue and its admission by KV memory (as vLLM's scheduler admits by free blocks).

A request is read once into a `Pending`: its policy built, its budget resolved, and what its prefill holds
beside the batch pool until its first token (the prompt, for a cache that prefills it whole). The cache
manager owns the memory: it answers whether the request can ever fit (`fits_alone`) and reserves it
(`reserve`: the running sequences share one padded batch pool, kvpop.cache.reservations). Requests are
admitted first come first served, no overtaking. When a bounded request does not fit, it is admitted at a
smaller budget if that is still >= `min_kv_budget` (degradation, recorded on the request and reported in
its result); otherwise it waits, and past `max_queue_size` requests waiting for memory the next is
refused as overloaded. Each sequence is reserved at its worst case (its budget, or prompt + max_tokens for
the full cache), so the engine cannot outgrow the pool however many requests arrive. A reserved request
waits for a place in the running batch (`max_batch_size`).

Repacking the batch pool (when sequences join or leave) briefly holds the old and the new pool arrays
together: give the instance that much headroom beyond its KV pool.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator

from kvpop.cache.reservations import storage_slots
from kvpop.cache.slot_cache import GROWTH_BLOCK
from kvpop.request import GenerationRequest

if TYPE_CHECKING:
    from kvpop.cache.manager import CacheManager
    from kvpop.cache.slot_cache import SlotCache
    from kvpop.policies import EvictionPolicy


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
    """A request as the engine reads it once: its policy, its resolved budget, and its admission."""

    request: GenerationRequest
    policy: "EvictionPolicy"
    budget: int | None  # slots per head (None: the full cache); a degraded request's reduced budget
    prefill_slots: int = 0  # slots per head its whole-prompt prefill holds beside the pool until its first token
    prefilled: "tuple[SlotCache, int] | None" = None  # a cache holding its whole prompt, and its first token
    reserved: bool = False  # its KV memory is reserved: it waits only for a place in the running batch
    degraded_from: int | None = None  # the budget it asked for, when admission reduced it

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def storage_slots(self) -> int:
        """Storage slots per head its cache can take (whole growth blocks)."""
        return storage_slots(self.budget, len(self.request.prompt_ids), self.request.sampling.max_tokens)


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

    def check_fits(self, pending: Pending) -> None:
        """ValueError unless the request could ever run here (alone, degraded if allowed)."""
        floor = self.policy.min_kv_budget
        fits = self.manager.fits_alone(pending.storage_slots) or (
            pending.budget is not None and floor is not None and self.manager.fits_alone(
                storage_slots(min(floor, pending.budget), len(pending.request.prompt_ids), pending.request.sampling.max_tokens)))
        if not fits:
            raise ValueError(f"request needs {pending.storage_slots} KV slots per head, more than this instance's KV pool "
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
        """Reserve the request's memory, at a smaller budget down to `min_kv_budget` if need be."""
        request = pending.request
        if self.manager.reserve(request.request_id, pending.storage_slots, pending.prefill_slots) is not None:
            pending.reserved = True
            return True
        if pending.budget is None or self.policy.min_kv_budget is None:
            return False
        asked = pending.budget
        budget = (min(asked, pending.storage_slots) // GROWTH_BLOCK) * GROWTH_BLOCK
        while budget >= max(self.policy.min_kv_budget, 1):
            slots = storage_slots(budget, len(request.prompt_ids), request.sampling.max_tokens)
            if self.manager.reserve(request.request_id, slots, pending.prefill_slots) is not None:
                pending.budget, pending.degraded_from, pending.reserved = budget, asked, True
                return True
            budget -= GROWTH_BLOCK
        return False
