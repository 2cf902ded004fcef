"""KV memory promised to admitted requests: the cache manager's ledger of the instance's KV pool.

Why reserve ahead: a bounded sequence's cache size is known before it starts, so admission can promise
it its worst case and the engine can never outgrow the pool however many requests arrive. The running
sequences share one batch pool of shape (L, B, Hkv, S, D) whose slot count S is the largest cache
among them, so what a set of sequences needs is B x max(slots) x bytes per slot (`padded_bytes`).

A reservation is two parts: the cache's storage (whole growth blocks, held until the request ends) and,
for a cache that prefills its prompt whole, the prompt's keys and values beside the pool until its
first token (`prefill_done`). Both come from the request's `AdmissionPlan`: its cache configuration as
the cache manager reads it, once (`CacheManager.plan`). A request alone always gets its prefill part
(its prompt is the instance's headroom). A reservation must also fit beside what the engine really held after its last
step (`observe_in_use`): finished rows leave the pool only at its next repack.

The ledger outlives an engine (a service restarts its engine after a failure, and requests admitted
meanwhile keep their reservation). Not thread-safe: the engine calls it under its lock.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from kvpop.cache.pool import padded_bytes
from kvpop.cache.slot_cache import round_up_slots
from kvpop.model_spec import ModelSpec

if TYPE_CHECKING:
    from kvpop.policies import EvictionPolicy


def reserved_slots(budget: int | None, prompt_tokens: int, max_tokens: int) -> int:
    """Slots per head a sequence can ever hold: every token it sees, at most its budget."""
    tokens = prompt_tokens + max_tokens
    return tokens if budget is None else min(budget, tokens)


def storage_slots(budget: int | None, prompt_tokens: int, max_tokens: int) -> int:
    """The storage (slots per head, whole growth blocks) reserved for such a sequence."""
    return round_up_slots(reserved_slots(budget, prompt_tokens, max_tokens))


@dataclass(frozen=True)
class AdmissionPlan:
    """A request's cache as the manager reads its configuration, once (`CacheManager.plan`): what admission
    reserves, what the allocation builds and what the result reports, so none of them reads it again."""

    policy_name: str
    policy: "EvictionPolicy"  # built on the model's assets; the sequence's cache keeps it
    budget: int | None  # slots per head (None: the full cache); a degraded plan's reduced budget
    prompt_tokens: int
    max_tokens: int
    prefill_slots: int  # slots per head its whole-prompt prefill holds beside the pool until its first token
    fits: bool  # whether it can ever run here alone (at the degradation floor, when it may be degraded)
    # The configuration as a saved session or warm prefix must match it; None when neither can continue
    # the request (no session, no warm prefix when it was planned): a dictionary copy costs more than the plan.
    configuration: dict[str, Any] | None
    degraded_from: int | None = None  # the budget it asked for, when admission reduced it

    @property
    def reserved_slots(self) -> int:
        return reserved_slots(self.budget, self.prompt_tokens, self.max_tokens)

    @property
    def storage_slots(self) -> int:
        return storage_slots(self.budget, self.prompt_tokens, self.max_tokens)

    def degraded(self, budget: int) -> "AdmissionPlan":
        """This plan at a smaller budget (a tight KV pool), the budget it asked for recorded."""
        return replace(self, budget=budget, degraded_from=self.budget)


@dataclass(frozen=True)
class Reservation:
    """KV memory held for one admitted request."""

    request_id: str
    slots: int  # slots per head of its cache's storage, until the request ends
    prefill_slots: int = 0  # slots per head its whole-prompt prefill holds beside the pool, until its first token


class KVReservations:
    """Reserved and in-use bytes of one instance's KV pool of `capacity_bytes` (None: no limit)."""

    def __init__(self, capacity_bytes: int | None, spec: ModelSpec) -> None:
        if capacity_bytes is not None and capacity_bytes <= 0:
            raise ValueError(f"a KV pool of {capacity_bytes} bytes holds nothing")
        self.capacity_bytes = capacity_bytes
        self.bytes_per_slot = spec.kv_bytes_per_token  # one slot in every layer and KV head
        self._slots: dict[str, int] = {}  # request id -> reserved storage slots per head
        self._prefill_slots: dict[str, int] = {}  # request id -> slots its whole-prompt prefill holds
        self.in_use_bytes = 0  # what the instance really held after the engine's last step (CacheManager.held_bytes)

    @property
    def reserved_bytes(self) -> int:
        pool = padded_bytes(list(self._slots.values()), self.bytes_per_slot)
        return pool + sum(self._prefill_slots.values()) * self.bytes_per_slot

    def holds_alone(self, slots: int) -> bool:
        """Whether a cache of `slots` slots per head fits the pool with nothing else running."""
        return self.capacity_bytes is None or slots * self.bytes_per_slot <= self.capacity_bytes

    def fits(self, slots: int, prefill_slots: int = 0) -> bool:
        """Whether a reservation of this size fits beside the others and beside what the engine holds."""
        if self.capacity_bytes is None:
            return True
        if not self._slots:
            prefill_slots = 0  # alone, a request runs whatever its prompt; others then count it
        prefilling = sum(self._prefill_slots.values()) + prefill_slots
        padded = padded_bytes([*self._slots.values(), slots], self.bytes_per_slot) + prefilling * self.bytes_per_slot
        return (padded <= self.capacity_bytes
                and self.in_use_bytes + (slots + prefill_slots) * self.bytes_per_slot <= self.capacity_bytes)

    def add(self, reservation: Reservation) -> Reservation:
        self._slots[reservation.request_id] = reservation.slots
        if reservation.prefill_slots:
            self._prefill_slots[reservation.request_id] = reservation.prefill_slots
        return reservation

    def prefill_done(self, request_id: str) -> None:
        self._prefill_slots.pop(request_id, None)

    def release(self, request_id: str) -> None:
        self._slots.pop(request_id, None)
        self._prefill_slots.pop(request_id, None)
