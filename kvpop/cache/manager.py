"""The cache manager: the one owner of every sequence's KV state, running or kept between turns.

Why a facade (as vLLM's `kv_cache_manager.py` over `block_pool.py`): the engine schedules requests and
runs the decoder; where keys and values live, how big they may get and how they are kept across turns
is one concern. The engine and its scheduler (admission included) talk to this class alone for cache
things and get small results back (`AdmissionPlan`, `Allocation`, `Reservation`, `GenerationResult`, the
decoder's past arrays), never the pool, the ledger, the store or a policy's internals.

What it owns:
  - the slot caches of running sequences, by request id (`allocate` / `finish` / `free`), each with
    what its policy made of the prompt (`EvictionPolicy.prompt_state`);
  - the batch pool whose rows the decoding caches view (zero-copy), and the device mirror of that
    pool when the decoder keeps the cache in device memory (`DeviceKVStore`, built by the decoder,
    which knows its provider; synced only here);
  - a request's cache configuration, read once into its `AdmissionPlan` (`plan`: the policy built, the
    budget resolved, the storage and prefill slots, whether it can ever fit); everything a request goes
    through below takes the plan, never the configuration again;
  - the instance's KV memory: what the scheduler's admission reserves for a plan (`reserve` /
    `prefill_done` / `release`: storage in whole `GROWTH_BLOCK`s, plus a whole-prompt prefill's prompt
    until its first token; `kvpop.cache.reservations`) and every byte the instance holds
    (`held_bytes`: running sequences, hot sessions, warm prefixes; `observe_in_use`);
  - the session store (hot / warm / cold tiers, `kvpop.sessions.store`): `save_session`,
    `restore_session` (inside `allocate`), `close_session`; snapshots by `kvpop.cache.snapshot`;
  - the warm prefixes (`kvpop.cache.prefix_cache`): `save_prefix` at load, a copy of the longest
    matching one inside `allocate` when no session state continues the request.

Flow of one engine step:
  1. admit: `allocate(request, plan)` returns the sequence's cache: the session's saved state when the
     prompt continues it, else a warm prefix's state when the prompt starts with one, else an empty
     cache reserved at its worst case (each a copy the sequence owns);
  2. prefill: `prefill_inputs(request_ids)` gives the decoder one cache's own arrays (no copy) or,
     for a batched chunk or a piece of one, stacked copies padded to the largest (a chunk's earlier
     pieces after the cache's slots); `store_pieces` appends each row whose chunk is whole and stages
     the rest (the policy decides, the slot cache applies);
  3. decode: `decode_inputs(caches)` binds the caches to the pool's rows (copies only when the batch
     changes), syncs the device mirror (scattered written slots), returns what the decoder reads in
     place; `store_decode` appends the new tokens (caches whose policy names a decode group, together:
     `EvictionPolicy.append_decode_group`);
  4. finish: `finish` builds the result, keeps the session (a copy of the cache) or closes it, frees
     the cache; `release_batch` when nothing decodes any more.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping

import numpy as np

from kvpop.cache.pool import BatchSlotPool
from kvpop.cache.prefix_cache import PrefixCache
from kvpop.cache.reservations import AdmissionPlan, KVReservations, Reservation, storage_slots
from kvpop.cache.slot_cache import GROWTH_BLOCK, SlotCache
from kvpop.model_spec import ModelSpec
from kvpop.policies import EvictionPolicy, prepare_policies
from kvpop.request import FinishReason, GenerationResult, Tier
from kvpop.cache.snapshot import capture_state, restore_cache
from kvpop.cache.staging import PromptStaging, append_output
from kvpop.sessions import SessionState, SessionStore

if TYPE_CHECKING:
    import onnxruntime as ort

    from kvpop.device_store import DeviceKVStore
    from kvpop.decoder import StepOutput
    from kvpop.request import CacheConfig, GenerationRequest

log = logging.getLogger(__name__)
PREFIX_FINGERPRINT = "warm-prefix"  # snapshots live and die with the loaded model: no model fingerprint needed


@dataclass(frozen=True)
class Allocation:
    """An admitted request's cache, the plan it was made by, and how much of its prompt it already holds."""

    cache: SlotCache
    plan: AdmissionPlan
    tokens_reused: int = 0  # prompt tokens already in `cache` (not to be computed again)
    session_tier: Tier | None = None  # the session's state came from this tier
    prefix_lookup: bool = False  # the warm prefixes were searched for this request
    prefix_tokens_reused: int = 0  # of `tokens_reused`, those that came from a warm prefix


class CacheManager:
    """Every running sequence's slot cache, the batch pool they share and the sessions kept after them.

    Used by the one thread that drives the engine."""

    def __init__(
        self,
        spec: ModelSpec,
        device_store: "DeviceKVStore | None" = None,
        sessions: SessionStore | None = None,
        policy_assets: "Mapping[str, Any] | None" = None,
        prefixes: PrefixCache | None = None,
        tokenizer: Any = None,
        reservations: KVReservations | None = None,
    ) -> None:
        """`reservations`: the instance's KV pool ledger (it outlives an engine; None: an unlimited one)."""
        self.spec = spec
        self.tokenizer = tokenizer  # what policies that read the prompt's text see it with (None: none)
        self.dtype = np.dtype(spec.dtype)
        self.device_store = device_store
        self.pool = BatchSlotPool(spec, track_writes=device_store is not None)
        self.sessions = sessions  # finished sequences with a session_id are kept here
        self.policy_assets = dict(policy_assets or {})  # policy name -> what it loaded for the model (kvpop: its scorers)
        self.prefixes = prefixes if prefixes is not None else PrefixCache()  # shared by a service's engines
        self._caches: dict[str, SlotCache] = {}  # request id -> cache of a running sequence
        self.staging = PromptStaging(spec)  # prompt chunks computed in pieces, by request id
        self.batch_decode = True  # vectorised decode appends (False: every append per sequence, as a check)
        # The last decode step's vectorised groups (EvictionPolicy.append_decode_group) by group key: kept
        # so the next step with the same caches does not stack their per-slot arrays again.
        self._decode_groups: dict = {}
        self.reservations = reservations if reservations is not None else KVReservations(None, spec)
        prepare_policies(self.policy_assets, tokenizer, spec.vocab_size)

    def plan(self, request: "GenerationRequest", min_budget: int | None,
             prefills_whole: Callable[[EvictionPolicy, int | None, int], bool]) -> AdmissionPlan:
        """The request's cache configuration read, once: its policy built on the model's assets, its budget
        resolved, what its cache and its prefill take (`prefills_whole`: the scheduler's decision), and
        whether it can ever fit the KV pool alone (at `min_budget`, when a bounded cache may be degraded
        that far). ValueError when this model cannot run its policy (a learned scorer it names is not loaded)."""
        config = request.cache
        try:
            policy = config.build_policy(self.policy_assets)
        except ValueError as error:
            raise ValueError(f"request {request.request_id!r}: {error}") from None
        prompt, max_tokens = len(request.prompt_ids), request.sampling.max_tokens
        budget = config.resolve_budget(prompt, max_tokens)
        holds = self.reservations.holds_alone
        fits = holds(storage_slots(budget, prompt, max_tokens)) or (
            budget is not None and min_budget is not None and holds(storage_slots(min(min_budget, budget), prompt, max_tokens)))
        matched = request.session_id is not None or len(self.prefixes) > 0  # a saved state may continue it
        return AdmissionPlan(config.policy, policy, budget, prompt, max_tokens,
                             prompt if prefills_whole(policy, budget, prompt) else 0, fits, asdict(config) if matched else None)

    # -- KV memory reserved at admission (kvpop.cache.reservations) ------------------------------

    def reserve(self, request_id: str, slots: int, prefill_slots: int = 0) -> Reservation | None:
        """Reserve a cache of `slots` storage slots per head and `prefill_slots` until `prefill_done`, if
        they fit the KV pool now; None: nothing reserved."""
        if not self.reservations.fits(slots, prefill_slots):
            return None
        return self.reservations.add(Reservation(request_id, slots, prefill_slots))

    def prefill_done(self, request_id: str) -> None:
        """The request's first token: its whole-prompt prefill no longer holds the prompt."""
        self.reservations.prefill_done(request_id)

    def release(self, request_id: str) -> None:
        """The request ended (or never started): its reservation goes."""
        self.reservations.release(request_id)

    @property
    def reserved_bytes(self) -> int:
        return self.reservations.reserved_bytes

    @property
    def held_bytes(self) -> int:
        """Every byte of keys and values the instance holds now, in one sum: the running sequences
        (`kv_bytes_in_use`), the hot sessions and the warm prefixes."""
        return self.kv_bytes_in_use + self.hot_session_bytes + self.prefixes.nbytes

    def observe_in_use(self) -> int:
        """What the instance holds now (`held_bytes`), recorded in the ledger for the next reservations;
        call it from the step thread after a step."""
        self.reservations.in_use_bytes = self.held_bytes
        return self.reservations.in_use_bytes

    # -- running sequences ----------------------------------------------------------------------

    def allocate(self, request: "GenerationRequest", plan: AdmissionPlan) -> Allocation:
        """The cache a newly admitted request starts from: its session's saved state when the prompt
        continues it, else the longest warm prefix it starts with, else empty (with its worst case
        reserved so that it never grows in the pool), as its `plan` says (a degraded one's budget)."""
        allocation = self.restore_session(request, plan) if request.session_id is not None else None
        if allocation is None and plan.configuration is not None and len(self.prefixes):
            allocation = self.restore_prefix(request, plan)
        if allocation is None:
            allocation = Allocation(self._empty(plan), plan)
        cache = allocation.cache
        cache.prompt_state = cache.policy.prompt_state(request.prompt_ids, self.tokenizer, self.spec.vocab_size)
        self._caches[request.request_id] = cache
        return allocation

    def adopt(self, request: "GenerationRequest", cache: SlotCache, plan: AdmissionPlan) -> Allocation:
        """A cache that already holds the request's whole prompt (`Engine.add_prefilled`), taken as the request's
        own; its policy and budget must be its plan's."""
        if cache.budget != plan.budget or cache.policy.name != plan.policy_name:
            raise ValueError(f"request {request.request_id!r}: a {cache.policy.name} cache of {cache.budget} slots is not the "
                             f"{plan.policy_name} cache of {plan.budget} slots its configuration gives")
        self._caches[request.request_id] = cache
        return Allocation(cache, plan, tokens_reused=cache.tokens_seen)

    def _empty(self, plan: AdmissionPlan) -> SlotCache:
        """A new cache; a bounded one takes its whole storage now (what admission reserved)."""
        return SlotCache(self.spec, plan.policy, plan.budget, 0 if plan.budget is None else plan.reserved_slots)

    def finish(self, allocation: Allocation, request: "GenerationRequest", output_ids: list[int], reason: FinishReason,
               matched_stop: str | None = None) -> GenerationResult:
        """A sequence's end: its result from its cache, its session kept (a copy of the cache and the
        tokens it has seen: all but the last sampled one) or closed as the request asks, its cache freed."""
        cache, plan = allocation.cache, allocation.plan
        result = GenerationResult(
            request_id=request.request_id,
            prompt_ids=request.prompt_ids,
            output_ids=output_ids,
            finish_reason=reason,
            budget=cache.budget if cache.budget is not None else cache.length,
            peak_kv_bytes=cache.peak_bytes,
            tokens_evicted=cache.tokens_evicted,
            compression=cache.tokens_evicted / cache.tokens_seen if cache.tokens_seen else 0.0,
            tokens_seen=cache.tokens_seen,
            policy=plan.policy_name,
            matched_stop=matched_stop,
            tokens_reused=allocation.tokens_reused,
            session_tier=allocation.session_tier,
            prefix_lookup=allocation.prefix_lookup,
            prefix_tokens_reused=allocation.prefix_tokens_reused,
            degraded_from=plan.degraded_from,
        )
        if request.session_id is not None and request.end_session:
            self.close_session(request.session_id)
        elif request.session_id is not None and reason != FinishReason.CANCELLED:
            history = (request.prompt_ids + output_ids)[: cache.tokens_seen]
            self.save_session(request.session_id, cache, history, plan.configuration)
        self.free(request.request_id)
        return result

    def free(self, request_id: str) -> None:
        """Forget a finished sequence's cache (its pool row goes at the next repack or release)."""
        self._caches.pop(request_id, None)
        self.staging.drop(request_id)

    def release_batch(self) -> None:
        """Drop the batch pool's arrays (nothing is decoding)."""
        self.pool.release()
        self._decode_groups = {}

    @property
    def kv_bytes_in_use(self) -> int:
        """Key/value bytes held now: the batch pool, caches outside it (being prefilled) and the prompt
        chunks staged beside them (a whole prompt while it is computed in pieces)."""
        outside = sum(cache.nbytes for cache in self._caches.values() if cache.storage_owner is not self.pool)
        return self.pool.nbytes + outside + self.staging.nbytes

    # -- what the decoder reads and what it returns -----------------------------------------------

    def prefill_inputs(self, request_ids: list[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(past_key, past_value, slot_mask) for a prompt chunk (or piece) of these sequences: (L, B, Hkv, S,
        D) twice, (B, S); a chunk's pieces computed so far are valid slots after the cache's."""
        return self.staging.inputs([self._caches[request_id] for request_id in request_ids], request_ids)

    def store_pieces(self, request_ids: list[str], chunk_lengths: list[int], out: "StepOutput") -> None:
        """Row r of a prompt call: staged, and appended to its cache with the pieces before it once its
        chunk of `chunk_lengths[r]` tokens is whole (kvpop.cache.staging)."""
        self.staging.store([self._caches[request_id] for request_id in request_ids], request_ids, chunk_lengths, out)

    def staged_tokens(self, request_id: str) -> int:
        """Tokens of the sequence's current prompt chunk computed but not yet in its cache."""
        return self.staging.length(request_id)

    def decode_inputs(self, caches: list[SlotCache]) -> "tuple[np.ndarray | ort.OrtValue, np.ndarray | ort.OrtValue, np.ndarray]":
        """(past_key, past_value, slot_mask) for a decode step of `caches`: the pool's arrays (or their
        device copies), which the caches' rows view, so a steady-state step copies nothing."""
        self.pool.bind(caches)
        slot_mask = self.pool.slot_mask(caches)  # (B, S)
        if self.device_store is None:
            return self.pool.key, self.pool.value, slot_mask
        key, value = self.device_store.sync(self.pool)
        return key, value, slot_mask

    def store_decode(self, caches: list[SlotCache], out: "StepOutput") -> None:
        """A decode step's new tokens (caches bound by `decode_inputs`, in its order): full kvpop caches
        in vectorised groups (kvpop.policies.kvpop.decode_batch), the rest one by one."""
        rows = self._append_decode_groups(caches, out) if self.batch_decode else range(len(caches))
        for row in rows:
            append_output(caches[row], out, row)

    def _append_decode_groups(self, caches: list[SlotCache], out: "StepOutput") -> list[int]:
        """Append every cache whose policy names a decode group, a group at a time; the rows left."""
        groups: dict = defaultdict(list)
        rest = []
        for row, cache in enumerate(caches):
            group = cache.policy.decode_group(cache)
            (rest if group is None else groups[group]).append(row)
        stacked = {}  # kept for the next step: only this step's groups (finished caches are let go)
        for group, rows in groups.items():
            policy = caches[rows[0]].policy
            stacked[group] = policy.append_decode_group([caches[row] for row in rows], np.array(rows), self.pool,
                                                        out.new_key, out.new_value, self._decode_groups.get(group))
        self._decode_groups = stacked
        return rest

    # -- sessions -------------------------------------------------------------------------------

    def restore_session(self, request: "GenerationRequest", plan: AdmissionPlan) -> Allocation | None:
        """A copy of the session's saved cache when it fits this request: same model, same cache
        options and budget, and a prompt that starts with the saved tokens. None: a cold prefill."""
        state, tier = self.sessions.lookup(request.session_id)
        if state is None or state.fingerprint != self.sessions.fingerprint or state.budget != plan.budget:
            return None
        if state.cache_options != plan.configuration or not state.reusable_for(request.prompt_ids):
            return None
        return Allocation(self._continue(state, plan), plan, state.tokens_seen, tier)

    def _continue(self, state: SessionState, plan: AdmissionPlan) -> SlotCache:
        """A new cache continuing `state` (its own copies), with the request's worst case reserved."""
        cache = restore_cache(state, self.spec, plan.policy)
        if plan.budget is not None:
            cache.reserve(plan.reserved_slots)
        return cache

    def save_session(self, session_id: str, cache: SlotCache, history: list[int], configuration: dict[str, Any]) -> None:
        """Keep a copy of a finished turn's cache and the tokens it has seen (`configuration`: its plan's, what
        the next turn must match); a failure (a full disk) is logged, never raised: the next turn then prefills cold."""
        try:
            self.sessions.put(session_id, capture_state(cache, history, self.sessions.fingerprint, configuration))
        except Exception:
            log.exception("state of session turn not kept")

    def close_session(self, session_id: str) -> bool:
        """Forget a session's saved state (memory and disk); whether there was one."""
        return self.sessions.remove(session_id) if self.sessions is not None else False

    # -- warm prefixes --------------------------------------------------------------------------

    def restore_prefix(self, request: "GenerationRequest", plan: AdmissionPlan) -> Allocation:
        """A copy of the longest warm prefix the prompt starts with (same cache configuration), or an
        empty cache; either way the lookup is reported."""
        snapshot = self.prefixes.match(plan.configuration, plan.budget, request.prompt_ids)
        if snapshot is None:
            return Allocation(self._empty(plan), plan, prefix_lookup=True)
        tokens = snapshot.tokens_seen
        return Allocation(self._continue(snapshot, plan), plan, tokens, prefix_lookup=True, prefix_tokens_reused=tokens)

    def save_prefix(self, cache: SlotCache, tokens: list[int], cache_config: "CacheConfig") -> None:
        """Keep a copy of a prefilled prefix's cache for requests of this configuration."""
        self.prefixes.add(capture_state(cache, tokens, PREFIX_FINGERPRINT, asdict(cache_config)))

    @property
    def hot_session_bytes(self) -> int:
        """Bytes of sessions kept in instance memory (they count against the KV pool)."""
        return self.sessions.hot_bytes if self.sessions is not None else 0


__all__ = ["GROWTH_BLOCK", "AdmissionPlan", "Allocation", "CacheManager", "KVReservations", "PrefixCache", "Reservation", "append_output"]
