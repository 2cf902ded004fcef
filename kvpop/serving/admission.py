"""Admission by KV memory: every bounded sequence's cache size is known before it starts.

The running sequences share one batch pool of shape (L, B, Hkv, S, D) whose slot count S is the
largest cache among them, so the memory a set of sequences needs is B x max(slots) x bytes/slot.
A request is admitted while that padded size, with the request included, stays within the
instance's KV pool. When it does not fit, a bounded request is admitted at a smaller budget if that
is still >= the configured floor (graceful degradation, reported back); otherwise it waits in a FIFO
queue, and past the queue limit it is rejected as overloaded. Admission reserves each sequence's
worst case (full budget, or prompt + max_tokens for the full cache), so the engine cannot outgrow
the pool however many requests arrive.

A cache that prefills its prompt whole (the engine's `whole_prompt_tokens`) also holds the prompt's
keys and values until its first token: admission reserves those slots beside the pool until then
(`prefill_done`), so several long prompts never prefill at once beyond the pool. A request alone is
admitted whatever its prompt (that prompt is the instance's headroom, as before).

The engine frees a finished sequence's row only when it next repacks the batch pool, so a request
is admitted only if it also fits beside the bytes the engine actually held after its last step.
Repacking itself (when sequences join or leave) briefly holds the old and the new pool arrays
together: give the instance that much headroom beyond kv_pool_mb.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvpop.cache.manager import GROWTH_BLOCK, padded_bytes, round_up_slots, slots_needed
from kvpop.request import GenerationRequest
from kvpop.model_spec import ModelSpec


class OverloadedError(RuntimeError):
    """The queue is full: the client should retry later."""


@dataclass(frozen=True)
class AdmissionPolicy:
    kv_pool_bytes: int  # KV bytes this instance may hold for all its running sequences
    min_kv_budget: int  # never degrade a request below this many slots per head
    max_queue_size: int  # requests allowed to wait; more are rejected as overloaded

    def __post_init__(self) -> None:
        if self.kv_pool_bytes <= 0 or self.min_kv_budget <= 0 or self.max_queue_size < 0:
            raise ValueError(f"invalid admission policy {self}")


@dataclass(frozen=True)
class Admission:
    request: GenerationRequest  # possibly with a reduced budget
    slots: int  # slots per head reserved
    degraded_from: int | None = None  # the budget asked for, when it was reduced


class KVPoolAdmission:
    """Reserves pool memory per running request. Used by the one engine worker thread only."""

    def __init__(self, policy: AdmissionPolicy, spec: ModelSpec) -> None:
        self.policy = policy
        self.bytes_per_slot = spec.kv_bytes_per_token  # one slot in every layer and KV head
        self._running: dict[str, int] = {}  # request id -> reserved slots per head
        self._prefilling: dict[str, int] = {}  # request id -> slots its whole-prompt prefill holds, until its first token
        self.engine_bytes = 0  # what the engine actually held after its last step

    @property
    def reserved_bytes(self) -> int:
        return self._pool_bytes(list(self._running.values())) + sum(self._prefilling.values()) * self.bytes_per_slot

    def _pool_bytes(self, slots: list[int]) -> int:
        return padded_bytes(slots, self.bytes_per_slot)

    @staticmethod
    def slots_needed(request: GenerationRequest) -> int:
        """Slots per head the request's cache can take (the cache manager's sizing)."""
        return slots_needed(request.cache, len(request.prompt_ids), request.sampling.max_tokens)

    def observe_engine(self, bytes_in_use: int) -> None:
        self.engine_bytes = bytes_in_use

    def _fits(self, slots: int, prefill: int = 0) -> bool:
        capacity = self.policy.kv_pool_bytes
        if not self._running:
            prefill = 0  # alone, a request runs whatever its prompt (fits_when_idle); others then count it
        prefilling = sum(self._prefilling.values()) + prefill
        padded = self._pool_bytes([*self._running.values(), slots]) + prefilling * self.bytes_per_slot
        return padded <= capacity and self.engine_bytes + (slots + prefill) * self.bytes_per_slot <= capacity

    def fits_when_idle(self, request: GenerationRequest) -> bool:
        """Whether the request could ever run here (alone, degraded if allowed)."""
        slots = self.slots_needed(request)
        if request.cache.policy != "full":
            slots = min(slots, round_up_slots(self.policy.min_kv_budget))
        return slots * self.bytes_per_slot <= self.policy.kv_pool_bytes

    def try_admit(self, request: GenerationRequest, prefill_slots: int = 0) -> Admission | None:
        """Reserve memory for `request` now, degrading its budget if needed; None if it must wait.
        `prefill_slots`: what its prefill holds beyond its cache until its first token
        (`Engine.prefill_slots`), reserved until `prefill_done`."""
        slots = self.slots_needed(request)
        if self._fits(slots, prefill_slots):
            return self._reserve(Admission(request, slots), prefill_slots)
        if request.cache.policy == "full":
            return None
        asked = request.cache.resolve_budget(len(request.prompt_ids), request.sampling.max_tokens)
        budget = (min(asked, slots) // GROWTH_BLOCK) * GROWTH_BLOCK
        while budget >= self.policy.min_kv_budget and not self._fits(round_up_slots(budget), prefill_slots):
            budget -= GROWTH_BLOCK
        if budget < max(self.policy.min_kv_budget, 1):
            return None
        degraded = replace(request, cache=replace(request.cache, budget=budget, compression=None))
        return self._reserve(Admission(degraded, round_up_slots(budget), degraded_from=asked), prefill_slots)

    def _reserve(self, admission: Admission, prefill_slots: int) -> Admission:
        request_id = admission.request.request_id
        self._running[request_id] = admission.slots
        if prefill_slots:
            self._prefilling[request_id] = prefill_slots
        return admission

    def prefill_done(self, request_id: str) -> None:
        """The request's first token: its whole-prompt prefill no longer holds the prompt."""
        self._prefilling.pop(request_id, None)

    def release(self, request_id: str) -> None:
        self._running.pop(request_id, None)
        self._prefilling.pop(request_id, None)
