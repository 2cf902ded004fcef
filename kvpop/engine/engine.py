"""The generation loop: one queue of requests, in-flight batching of sequences, each with its own
fixed-budget slot cache.

Every `step` (one driving thread): apply cancellations, take what the scheduler admits (its waiting
queue, by KV memory and batch room: kvpop.engine.scheduler, kvpop.engine.admission), then run the step
it sizes (one batched decode step of every sequence whose prompt is in, and prompt pieces of the
admitted ones under the step's token budget), sample, and finish sequences that stop. Everything
about where keys and values live (slot caches, the batch pool and its device mirror, sessions kept
between turns, warm prefixes) is the cache manager's (`kvpop.cache.manager`); the engine asks it.
`add_request` and `cancel` may be called from other threads: they only touch the queue and the KV
reservations under the engine's lock; everything else belongs to the thread calling `step`.
"""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Mapping, Protocol

from kvpop.cache.manager import CacheManager, KVReservations
from kvpop.cache.prefix_cache import PrefixCache
from kvpop.cache.slot_cache import SlotCache
from kvpop.decoder import DecoderStep
from kvpop.engine.admission import Pending
from kvpop.engine.config import EngineConfig
from kvpop.engine.detokenizer import IncrementalDetokenizer
from kvpop.engine.runner import ModelRunner
from kvpop.engine.scheduler import Scheduler
from kvpop.engine.sequence import EngineState, Phase, Sequence, SequenceState
from kvpop.policies import load_policy_assets
from kvpop.request import NO_TOKEN, CacheConfig, FinishReason, GenerationRequest, GenerationResult, TokenEvent
from kvpop.sampling import Sampler, SamplingParams
from kvpop.sessions import SessionStore, validate_session_id


class Tokenizer(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class Engine:
    def __init__(
        self,
        decoder: DecoderStep,
        config: EngineConfig | None = None,
        *,
        tokenizer: Tokenizer | None = None,
        policy_assets: Mapping[str, Any] | None = None,
        sessions: SessionStore | None = None,
        prefixes: PrefixCache | None = None,
        reservations: KVReservations | None = None,
    ) -> None:
        """`config`: how it batches, schedules and admits. `policy_assets`: what each policy loaded for the model,
        by policy name (kvpop.policies.registry.load_policy_assets), shared by its sequences; `tokenizer`: for
        the answers' text and stop strings (and policies that read the prompt's text). `sessions`, `prefixes` and
        `reservations` (the KV pool's ledger) outlive an engine (a service restarts its engine after a failure)."""
        self.config = config or EngineConfig()
        self.decoder = decoder
        self.spec = decoder.spec
        self.tokenizer = tokenizer
        self.policy_assets = dict(policy_assets or {})
        self.cache_manager = CacheManager(self.spec, decoder.device_store, sessions, self.policy_assets, prefixes, tokenizer,
                                          reservations)
        self.scheduler = Scheduler(self.config, decoder.has_mixed_step, self.cache_manager)
        self.runner = ModelRunner(decoder, self.cache_manager)
        self._lock = threading.Lock()  # guards the waiting queue, the KV reservations, _cancelled, _finished, _request_ids
        self._cancelled: set[str] = set()
        self._finished: dict[str, GenerationResult] = {}
        self._request_ids: set[str] = set()  # every id not yet released by `result`
        self._running: dict[str, Sequence] = {}  # step thread only: prompt in, decoding
        self._prefilling: dict[str, Sequence] = {}  # step thread only: admitted, prompt partly fed (FIFO)

    @classmethod
    def from_model_dir(cls, model_dir: Path, config: EngineConfig | None = None, device: str = "cpu", **services) -> "Engine":
        """An engine over an exported model directory, with its tokenizer and its policies' assets."""
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(Path(model_dir) / "tokenizer")
        services.setdefault("policy_assets", load_policy_assets(model_dir))
        return cls(DecoderStep(model_dir, device=device), config, tokenizer=tokenizer, **services)

    # -- public API (add_request / cancel / result / state are safe from other threads) -----------

    def add_request(self, request: GenerationRequest) -> None:
        """Queue a request; it joins the running batch once its KV memory is reserved and the batch has
        room (the scheduler's admission). Raises ValueError if invalid, OverloadedError when too many wait."""
        self._queue(request, None)

    def add_prefilled(self, request: GenerationRequest, cache: "SlotCache", first_token: int) -> None:
        """Queue a request whose whole prompt is already in `cache` (a cache of the request's configuration,
        the engine's from now on) and whose first token was sampled from the prompt's last logits: it joins
        the decoding batch at the next step. A prompt prefilled once and compressed several ways decodes its
        branches so (kvpop_eval.quality.prefill_once)."""
        if cache.tokens_seen != len(request.prompt_ids):
            raise ValueError(f"request {request.request_id!r}: its cache has seen {cache.tokens_seen} tokens, "
                             f"its prompt has {len(request.prompt_ids)}")
        self._queue(request, (cache, first_token))

    def _queue(self, request: GenerationRequest, prefilled: "tuple[SlotCache, int] | None") -> None:
        pending = self.read(request, prefilled)
        self.scheduler.waiting.check_fits(pending)  # ValueError: it could never run here
        with self._lock:
            if request.request_id in self._request_ids:
                raise ValueError(f"request id {request.request_id!r} is already in use")
            self.scheduler.waiting.add(pending)
            self._request_ids.add(request.request_id)

    def read(self, request: GenerationRequest, prefilled: "tuple[SlotCache, int] | None" = None) -> Pending:
        """The request read once: checked, then planned by the cache manager (`Scheduler.read`: its policy built,
        its budget resolved, what its cache and its prefill take, whether it can ever fit)."""
        self._check(request)
        return self.scheduler.read(request, prefilled)

    def _check(self, request: GenerationRequest) -> None:
        """ValueError unless this engine can run `request` (tokens, length, scorer, stops, session)."""
        bad = [token for token in request.prompt_ids if not 0 <= token < self.spec.vocab_size]
        if bad:
            raise ValueError(f"request {request.request_id!r}: token ids out of vocabulary [0, {self.spec.vocab_size}): {bad[:5]}")
        if len(request.prompt_ids) >= self.spec.max_position_embeddings:
            raise ValueError(
                f"request {request.request_id!r}: prompt of {len(request.prompt_ids)} tokens does not fit "
                f"the model's {self.spec.max_position_embeddings} positions"
            )
        if request.sampling.stop and self.tokenizer is None:
            raise ValueError(f"request {request.request_id!r}: stop strings need an engine with a tokenizer")
        if request.session_id is not None:
            if self.cache_manager.sessions is None:
                raise ValueError(f"request {request.request_id!r}: this engine keeps no sessions")
            validate_session_id(request.session_id)

    def cancel(self, request_id: str) -> None:
        """Stop a request at the next step and free its slots (unknown or finished ids are ignored)."""
        with self._lock:
            self._cancelled.add(request_id)

    def has_unfinished(self) -> bool:
        with self._lock:
            return bool(len(self.scheduler.waiting) or self._running or self._prefilling)

    def result(self, request_id: str) -> GenerationResult:
        """The finished request's result; releases it (and its id)."""
        with self._lock:
            if request_id not in self._finished:
                state = "unknown" if request_id not in self._request_ids else "not finished"
                raise KeyError(f"request {request_id!r} is {state}")
            self._request_ids.discard(request_id)
            return self._finished.pop(request_id)

    def state(self) -> EngineState:
        """Request ids by phase (waiting, prefilling, decoding)."""
        with self._lock:
            waiting = tuple(pending.request_id for pending in self.scheduler.waiting)
            return EngineState(waiting, tuple(self._prefilling), tuple(self._running))

    def abandon(self) -> list[Pending]:
        """This engine failed and is given up: every reservation it holds goes back to the ledger (which
        outlives engines); its waiting requests are handed back to be read again by the next engine."""
        with self._lock:
            for request_id in (*self._prefilling, *self._running):
                self.cache_manager.release(request_id)
            return self.scheduler.waiting.remove({pending.request_id for pending in self.scheduler.waiting})

    def sequence(self, request_id: str) -> SequenceState | None:
        """An admitted request's progress and cache (read only); None unless it is prefilling or decoding."""
        if request_id in self._running:
            return self._running[request_id].view(Phase.DECODING)
        if request_id in self._prefilling:
            return self._prefilling[request_id].view(Phase.PREFILLING)
        return None

    @property
    def num_running(self) -> int:
        """Admitted sequences: decoding, or with their prompt being fed."""
        return len(self._running) + len(self._prefilling)

    @property
    def kv_bytes_in_use(self) -> int:
        """Key/value bytes of the running sequences: the batch pool, caches being prefilled, and the
        chunks they are prefilling (a whole prompt while it is computed in pieces)."""
        return self.cache_manager.kv_bytes_in_use

    @property
    def sessions(self) -> SessionStore | None:
        """The cache manager's session store (finished turns with a session_id are kept there)."""
        return self.cache_manager.sessions

    def generate(self, requests: list[GenerationRequest],
                 on_finished: Callable[[str], None] | None = None) -> list[GenerationResult]:
        """Run `requests` to completion (in-flight batched) and return their results in order;
        `on_finished(request_id)` as each one ends (progress of a long evaluation)."""
        for request in requests:
            self.add_request(request)
        pending = {request.request_id for request in requests}
        while pending:
            for event in self.step():
                if event.finished and event.request_id in pending:
                    pending.discard(event.request_id)
                    if on_finished is not None:
                        on_finished(event.request_id)
        return [self.result(request.request_id) for request in requests]

    def step(self) -> list[TokenEvent]:
        """One batched decode step of the running sequences, then prompt chunks of admitted ones."""
        with self._lock:
            cancelled, self._cancelled = self._cancelled, set()
            events = [self._finish_waiting(pending) for pending in self.scheduler.waiting.remove(cancelled)]
            admitted = self.scheduler.admit(self.num_running)
        for request_id in cancelled & (self._running.keys() | self._prefilling.keys()):
            sequence = self._running.get(request_id) or self._prefilling[request_id]
            events.append(self._finish(sequence, FinishReason.CANCELLED, NO_TOKEN))
        for pending in admitted:
            sequence = self._new_sequence(pending)
            if sequence.prompt_left:
                self._prefilling[pending.request_id] = sequence
            else:  # its cache already holds the whole prompt
                self._running[pending.request_id] = sequence
                events.append(self._accept(sequence, sequence.pending_token))
        events.extend(self._decode_and_prefill(list(self._running.values())))
        if not self._running:
            self.cache_manager.release_batch()
        return events

    def prefill(self, request: GenerationRequest) -> SequenceState:
        """A request's whole prompt fed alone, chunk by chunk, outside the queue, and its first token
        sampled (its cache stays allocated until `free`): the state a prefill leaves, to compare or keep."""
        sequence = self._new_sequence(self.read(request))
        out = self.runner.whole_prompt(sequence)
        sequence.pending_token = sequence.sampler(out.logits[0, -1])
        return sequence.view(Phase.DECODING)

    def free(self, request_id: str) -> None:
        """Release what `prefill` allocated."""
        self.cache_manager.free(request_id)

    def warm_prefix(self, prompt_ids: list[int], cache: CacheConfig) -> int:
        """Prefill a common prompt beginning alone and keep its cache state, so that requests of this
        cache configuration whose prompt starts with it begin from a copy (`kvpop.cache.prefix_cache`
        says what that equals). A bounded policy keeps the longest part that fills whole prefill
        chunks, where a cold prefill stands at a chunk boundary too. Returns the tokens kept (0: not
        one whole chunk). Call it before `step` runs (it uses the step thread's cache manager)."""
        if cache.compression is not None:
            raise ValueError("a warm prefix needs a fixed budget: a compression ratio's budget depends on each request")
        name, sampling = f"warm-prefix:{len(self.cache_manager.prefixes)}", SamplingParams(max_tokens=1)
        plan = self.scheduler.read(GenerationRequest(name, prompt_ids, sampling, cache)).plan
        if plan.prefill_slots:
            return 0  # a cold prefill would take prefix and rest as one chunk: no state to start it from
        chunk = self.scheduler.evicting_chunk(plan.budget)
        keep = len(prompt_ids) if plan.budget is None else len(prompt_ids) // chunk * chunk
        if keep == 0:
            return 0
        request = GenerationRequest(name, prompt_ids[:keep], sampling, cache)
        state = self.prefill(request)
        self.cache_manager.save_prefix(state.cache, request.prompt_ids, cache)
        self.free(request.request_id)
        return keep

    def close_session(self, session_id: str) -> bool:
        """Forget a session's saved state (memory and disk); whether there was one."""
        return self.cache_manager.close_session(session_id)

    # -- internals ----------------------------------------------------------------------------

    def _new_sequence(self, pending: Pending) -> Sequence:
        """An admitted request's sequence with the cache the manager gives it (empty, a session's
        saved state or a warm prefix's); the rest of its prompt is fed by `_decode_and_prefill`."""
        request, prefilled = pending.request, pending.prefilled
        allocation = (self.cache_manager.allocate(request, pending.plan) if prefilled is None
                      else self.cache_manager.adopt(request, prefilled[0], pending.plan))
        cache = allocation.cache
        prompt_left = len(request.prompt_ids) - allocation.tokens_reused
        detokenizer = IncrementalDetokenizer(self.tokenizer, request.sampling.stop) if self.tokenizer is not None else None
        return Sequence(
            request=request, allocation=allocation, sampler=Sampler(request.sampling), detokenizer=detokenizer,
            chunk_size=self.scheduler.chunk_size(cache.policy, cache.budget, prompt_left),
            prefilled=allocation.tokens_reused,
            query_window=self.scheduler.query_window(cache.policy, cache.budget, prompt_left, cache.length),
            pending_token=NO_TOKEN if prefilled is None else prefilled[1],
        )

    def _decode_and_prefill(self, decoding: list[Sequence]) -> list[TokenEvent]:
        """This step's model work: one decode step of the running sequences, and admitted prompts fed
        under the step's token budget, in rounds (`Scheduler.next_round`). The budget stands even if
        every decoded stream just finished: their last tokens leave with this step's events, so they
        wait too. The first call of equal-length pieces takes the decode step along when the scheduler
        `mixes`. A prompt whose last chunk went in samples its first token."""
        budget = self.scheduler.step_budget(bool(decoding))
        mixed = self.scheduler.mixes(decoding)
        events = self._decode(decoding) if decoding and not mixed else []
        decode_events: list[TokenEvent] = []
        used, started = 0, time.perf_counter()
        while self._prefilling and used < budget:
            pieces, used = self.scheduler.next_round(self._prefilling.values(), budget, used)
            if not pieces:
                break
            for length, sequences in pieces.items():
                if mixed and not self.scheduler.piece_reads_attention(sequences):
                    decode_out, out = self.runner.mixed(decoding, sequences, length)
                    decode_events = self._sample(decoding, decode_out)
                    mixed = False
                else:
                    out = self.runner.prompt_piece(sequences, length)
                for row, sequence in enumerate(sequences):
                    if sequence.prompt_left == 0:
                        sequence.pending_token = sequence.sampler(out.logits[row, -1])
                        del self._prefilling[sequence.request_id]
                        self._running[sequence.request_id] = sequence
                        events.append(self._accept(sequence, sequence.pending_token))
        if decoding:
            self.scheduler.observe_prompt_work(time.perf_counter() - started, used, shared_decode=bool(decode_events))
        if mixed:  # no prompt piece to share the call with
            decode_events = self._decode(decoding)
        return decode_events + events

    def _decode(self, sequences: list[Sequence]) -> list[TokenEvent]:
        """One decode step of `sequences` in its own decoder call, sampled."""
        started = time.perf_counter()
        events = self._sample(sequences, self.runner.decode(sequences))
        self.scheduler.observe_decode(time.perf_counter() - started)
        return events

    def _sample(self, sequences: list[Sequence], out) -> list[TokenEvent]:
        return [self._accept(sequence, sequence.sampler(out.logits[row, -1])) for row, sequence in enumerate(sequences)]

    def _accept(self, sequence: Sequence, token: int) -> TokenEvent:
        """Record a sampled token and decide whether the sequence ends with it."""
        sequence.output_ids.append(token)
        sequence.pending_token = token
        if len(sequence.output_ids) == 1:  # its first token: a whole-prompt prefill no longer holds the prompt
            with self._lock:
                self.cache_manager.prefill_done(sequence.request_id)
        sampling = sequence.request.sampling
        detokenizer = sequence.detokenizer
        stopped = detokenizer is not None and detokenizer.push(token) is not None  # a stop string, cut from the text
        if stopped or (token in self.spec.eos_token_ids and not sampling.ignore_eos):
            return self._finish(sequence, FinishReason.STOP, token)
        if len(sequence.output_ids) >= sampling.max_tokens or sequence.cache.tokens_seen + 1 >= self.spec.max_position_embeddings:
            return self._finish(sequence, FinishReason.LENGTH, token)
        text = detokenizer.take() if detokenizer is not None else ""
        return TokenEvent(sequence.request_id, token, finished=False, finish_reason=None, text=text)

    def _finish(self, sequence: Sequence, reason: FinishReason, token: int) -> TokenEvent:
        request = sequence.request
        self._running.pop(request.request_id, None)
        self._prefilling.pop(request.request_id, None)
        detokenizer = sequence.detokenizer
        if detokenizer is not None:
            detokenizer.flush()
        result = self.cache_manager.finish(sequence.allocation, request, sequence.output_ids, reason,
                                           detokenizer.matched_stop if detokenizer is not None else None)
        if detokenizer is not None:
            result = replace(result, text=detokenizer.text)
        with self._lock:
            self._finished[request.request_id] = result
            self.cache_manager.release(request.request_id)
        text = detokenizer.take(final=True) if detokenizer is not None else ""
        return TokenEvent(request.request_id, token, finished=True, finish_reason=reason, text=text)

    def _finish_waiting(self, pending: Pending) -> TokenEvent:
        """A request cancelled before it started (called under the lock)."""
        request = pending.request
        self._finished[request.request_id] = GenerationResult(
            request.request_id, request.prompt_ids, [], FinishReason.CANCELLED, budget=0, peak_kv_bytes=0,
            tokens_evicted=0, compression=0.0, policy=pending.plan.policy_name, started=False,
        )
        return TokenEvent(request.request_id, NO_TOKEN, finished=True, finish_reason=FinishReason.CANCELLED)
