"""The generation loop: in-flight batching of sequences, each with its own fixed-budget slot cache.

Every `step` (one driving thread): apply cancellations, admit waiting requests up to
`max_batch_size`, run ONE batched decode step over every sequence whose prompt is in, then feed
prompt work of the admitted ones under a per-step token budget (`max_step_tokens`, or paced to the
measured decode step: kvpop.prefill_pacer), as vLLM's scheduler interleaves chunked prefill with
decode: a long new prompt no longer stalls the running streams for its whole prefill, only for one
step's share of it. Pieces of several prompts that have the same length run as one batched call. A
prompt's chunk size is fixed by the request alone (`prefill_chunk`, at most max(budget,
`min_bounded_chunk`), evicting between chunks so peak memory stays bounded by budget + chunk; or, with
`whole_prompt_tokens`, the whole prompt, evicted once after it); a chunk
computed in pieces over several steps enters its cache once, whole (kvpop.cache.staged_chunk), so
outputs never depend on what else is running. Sequences of
different lengths and budgets share the decode step through the batch pool (padded slots are
masked); full kvpop caches append their decode tokens in vectorised groups (kvpop.cache.decode_batch).
The decoder step returns last-position logits only, and attention only when a policy in the call
reads it; when none in the step does, the decode step and the step's first prompt pieces run as one
mixed call (kvpop.decoder.DecoderStep.run_mixed: the weights are read once for both).
Everything about where the keys and values live (slot caches, the batch pool and its device mirror,
sessions kept between turns) is the cache manager's (`kvpop.cache.manager`); the engine asks it.
`add_request` and `cancel` may be called from other threads: they only touch the queue under the
engine's lock; everything else belongs to the thread calling `step`.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from kvpop.cache import SlotCache
from kvpop.cache.manager import Allocation, CacheManager, PrefixCache
from kvpop.cache.staged_chunk import StagedChunk
from kvpop.decoder import DecoderStep, StepInputs, StepOutput
from kvpop.prefill_pacer import PrefillPacer
from kvpop.policies import POLICIES, EvictionPolicy, TokenScorer, make_policy
from kvpop.policies.text_spans import TextSpans, line_break_table
from kvpop.request import NO_TOKEN, CacheConfig, FinishReason, GenerationRequest, GenerationResult, TokenEvent
from kvpop.sampling import Sampler, SamplingParams
from kvpop.scorer import LEARNED_SCORER_KINDS, learned_scorer
from kvpop.sessions import SessionStore, validate_session_id

MIN_PIECE_TOKENS = 16  # a step's budget left over after other prompt work starts no smaller piece


class Tokenizer(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


@dataclass
class _Sequence:
    request: GenerationRequest
    allocation: Allocation  # the cache the manager gave it, and how much of the prompt that held
    sampler: Sampler
    output_ids: list[int] = field(default_factory=list)
    pending_token: int = NO_TOKEN  # sampled, not yet fed to the model
    finish_reason: str | None = None
    matched_stop: str | None = None
    prefilled: int = 0  # prompt tokens run through the model so far (in the cache, or staged)
    chunk_size: int = 1  # prompt tokens per prefill chunk (what enters the cache at once)
    staged: StagedChunk | None = None  # the current chunk's pieces computed so far, not yet in the cache

    @property
    def cache(self) -> SlotCache:
        return self.allocation.cache

    @property
    def prompt_left(self) -> int:
        return len(self.request.prompt_ids) - self.prefilled

    @property
    def chunk_left(self) -> int:
        """Prompt tokens left in the current chunk (a chunk begins as min(chunk_size, prompt left))."""
        staged = 0 if self.staged is None else self.staged.length
        return min(self.chunk_size, self.prompt_left + staged) - staged


def load_learned_scorers(model_dir: Path) -> dict[str, TokenScorer]:
    """The KVpop scorers exported beside the decoder (`scorer_<kind>.onnx`), by kind."""
    from kvpop.scorer.runtime import LearnedScorer, ScorerRuntime

    return {kind: LearnedScorer.load(model_dir, kind) for kind in ScorerRuntime.available(model_dir)}


class Engine:
    def __init__(
        self,
        decoder: DecoderStep,
        tokenizer: Tokenizer | None = None,
        max_batch_size: int = 8,
        prefill_chunk: int = 256,
        learned_scorers: dict[str, TokenScorer] | None = None,
        max_step_tokens: int | None = None,
        sessions: SessionStore | None = None,
        prefixes: PrefixCache | None = None,
        min_bounded_chunk: int = 1,
        prefill_pacing: float | None = None,
        whole_prompt_tokens: int = 0,
    ) -> None:
        """`max_step_tokens`: prompt tokens fed per step while streams decode (default one
        `prefill_chunk`; a chunk longer than what is left is computed in pieces over several steps):
        the longest a running stream waits for prefill work between two tokens.
        `min_bounded_chunk`: a bounded cache's prompt chunks hold max(budget, this) tokens (at most
        `prefill_chunk`), so a small budget does not prefill a prompt in many small calls.
        `whole_prompt_tokens`: a bounded cache whose policy reads no attention takes a prompt of up to
        this many tokens (the part not already in its cache) as ONE chunk: prefilled with full
        attention, evicted once after it (compress after prefill, as kvpress does), holding the prompt's
        keys and values meanwhile. Evicting while prefilling changes the keys and values of everything
        after the first eviction, and costs the learned scorer most of its answers at 75-88%
        (docs/quality/real, session 20). 0, longer prompts, and policies that read attention (whose
        rows would be prompt x prompt) evict as they prefill.
        `prefill_pacing`: while streams decode, size each step's prompt work to about this many decode
        steps' time, measured as the engine runs (kvpop.prefill_pacer; `max_step_tokens` stays the
        ceiling); None: the token budget alone.
        `sessions` and `prefixes` outlive an engine (a service restarts its engine after a failure)."""
        max_step_tokens = prefill_chunk if max_step_tokens is None else max_step_tokens
        if max_batch_size < 1 or prefill_chunk < 1 or max_step_tokens < 1 or min_bounded_chunk < 1 or whole_prompt_tokens < 0:
            raise ValueError(
                f"max_batch_size, prefill_chunk, max_step_tokens and min_bounded_chunk must be >= 1 and "
                f"whole_prompt_tokens >= 0, got {max_batch_size}, {prefill_chunk}, {max_step_tokens}, "
                f"{min_bounded_chunk}, {whole_prompt_tokens}"
            )
        self.decoder = decoder
        self.spec = decoder.spec
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.prefill_chunk = prefill_chunk
        self.min_bounded_chunk = min_bounded_chunk
        self.whole_prompt_tokens = whole_prompt_tokens
        self.max_step_tokens = max_step_tokens
        self.pacer = PrefillPacer(prefill_pacing) if prefill_pacing else None
        self.learned_scorers = learned_scorers or {}  # kind -> scorer shared by this engine's sequences
        self._line_break_table: np.ndarray | None = None  # see _line_breaks
        if tokenizer is not None and any(scorer.span_pooling for scorer in self.learned_scorers.values()):
            self._line_breaks()  # now (0.13 s for SmolLM2's 49,152 tokens), not on a request's first step
        self.cache_manager = CacheManager(self.spec, decoder.device_store, sessions, self.learned_scorers, prefixes)
        self._lock = threading.Lock()  # guards _waiting, _cancelled, _finished, _request_ids
        self._waiting: deque[GenerationRequest] = deque()
        self._cancelled: set[str] = set()
        self._finished: dict[str, GenerationResult] = {}
        self._request_ids: set[str] = set()  # every id not yet released by `result`
        self._running: dict[str, _Sequence] = {}  # step thread only: prompt in, decoding
        self._prefilling: dict[str, _Sequence] = {}  # step thread only: admitted, prompt partly fed (FIFO)

    @classmethod
    def from_model_dir(cls, model_dir: Path, device: str = "cpu", **options: Any) -> "Engine":
        """An engine over an exported model directory, with its tokenizer for stop strings."""
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(Path(model_dir) / "tokenizer")
        options.setdefault("learned_scorers", load_learned_scorers(model_dir))
        return cls(DecoderStep(model_dir, device=device), tokenizer=tokenizer, **options)

    # -- public API (add_request / cancel / result are safe from other threads) -------------------

    def add_request(self, request: GenerationRequest) -> None:
        """Queue a request; it joins the running batch at the next step. Raises ValueError if invalid."""
        self._check(request)
        with self._lock:
            if request.request_id in self._request_ids:
                raise ValueError(f"request id {request.request_id!r} is already in use")
            self._request_ids.add(request.request_id)
            self._waiting.append(request)

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
        if request.cache.learned_scorer is not None:
            try:
                learned_scorer(request.cache.learned_scorer, self.learned_scorers)
            except ValueError as error:
                raise ValueError(f"request {request.request_id!r}: {error}") from None
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
            return bool(self._waiting or self._running or self._prefilling)

    def result(self, request_id: str) -> GenerationResult:
        """The finished request's result; releases it (and its id)."""
        with self._lock:
            if request_id not in self._finished:
                state = "unknown" if request_id not in self._request_ids else "not finished"
                raise KeyError(f"request {request_id!r} is {state}")
            self._request_ids.discard(request_id)
            return self._finished.pop(request_id)

    @property
    def num_running(self) -> int:
        """Admitted sequences: decoding, or with their prompt being fed."""
        return len(self._running) + len(self._prefilling)

    @property
    def kv_bytes_in_use(self) -> int:
        """Key/value bytes of the running sequences: the batch pool, caches being prefilled, and the
        chunks they are prefilling (a whole prompt while it is computed in pieces)."""
        staged = sum(sequence.staged.key.nbytes + sequence.staged.value.nbytes
                     for sequence in self._prefilling.values() if sequence.staged is not None)
        return self.cache_manager.kv_bytes_in_use + staged

    def prefill_slots(self, request: GenerationRequest) -> int:
        """Slots per head a request's prefill holds beyond its cache until its first token: its whole
        prompt when its bounded cache prefills it whole (`whole_prompt_tokens`), else 0 (a staged chunk
        of at most `prefill_chunk` tokens is the pool's headroom). Admission reserves it meanwhile."""
        prompt = len(request.prompt_ids)
        budget = request.cache.resolve_budget(prompt, request.sampling.max_tokens)
        return prompt if self.prefills_whole(request.cache.build_policy(self.learned_scorers), budget, prompt) else 0

    @property
    def sessions(self) -> SessionStore | None:
        """The cache manager's session store (finished turns with a session_id are kept there)."""
        return self.cache_manager.sessions

    def generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        """Run `requests` to completion (in-flight batched) and return their results in order."""
        for request in requests:
            self.add_request(request)
        pending = {request.request_id for request in requests}
        while pending:
            for event in self.step():
                if event.finished:
                    pending.discard(event.request_id)
        return [self.result(request.request_id) for request in requests]

    def step(self) -> list[TokenEvent]:
        """One batched decode step of the running sequences, then prompt chunks of admitted ones."""
        with self._lock:
            cancelled, self._cancelled = self._cancelled, set()
            events = [self._finish_waiting(request) for request in self._waiting if request.request_id in cancelled]
            self._waiting = deque(request for request in self._waiting if request.request_id not in cancelled)
            room = self.max_batch_size - self.num_running
            admitted = [self._waiting.popleft() for _ in range(min(len(self._waiting), room))]
        for request_id in cancelled & (self._running.keys() | self._prefilling.keys()):
            sequence = self._running.get(request_id) or self._prefilling[request_id]
            events.append(self._finish(sequence, FinishReason.CANCELLED, NO_TOKEN))
        for request in admitted:
            sequence = self._new_sequence(request)
            if sequence.prompt_left:
                self._prefilling[request.request_id] = sequence
            else:  # restored already prefilled (benchmarks/speed.py's snapshots)
                self._running[request.request_id] = sequence
                events.append(self._accept(sequence, sequence.pending_token))
        events.extend(self._decode_and_prefill(list(self._running.values())))
        if not self._running:
            self.cache_manager.release_batch()
        return events

    # -- internals ----------------------------------------------------------------------------

    def _new_sequence(self, request: GenerationRequest) -> _Sequence:
        """An admitted request's sequence with the cache the manager gives it (empty, a session's
        saved state or a warm prefix's); the rest of its prompt is fed by `_decode_and_prefill`."""
        allocation = self.cache_manager.allocate(request)
        pooling = allocation.cache.policy.span_pooling
        if pooling and self.tokenizer is not None:
            allocation.cache.text_spans = TextSpans.of_prompt(request.prompt_ids, self._line_breaks(), pooling)
        return _Sequence(
            request=request, allocation=allocation, sampler=Sampler(request.sampling),
            chunk_size=self._chunk_size(allocation.cache, len(request.prompt_ids) - allocation.tokens_reused),
            prefilled=allocation.tokens_reused,
        )

    def _line_breaks(self) -> np.ndarray:
        """(V,) which tokens end a line, for policies that rank by line (kvpop.policies.text_spans)."""
        if self._line_break_table is None:
            self._line_break_table = line_break_table(self.tokenizer, self.spec.vocab_size)
        return self._line_break_table

    def _chunk_size(self, cache: SlotCache, prompt_left: int) -> int:
        if self.prefills_whole(cache.policy, cache.budget, prompt_left):
            return prompt_left
        return self._evicting_chunk(cache.budget)

    def prefills_whole(self, policy: EvictionPolicy, budget: int | None, prompt_left: int) -> bool:
        """Whether this bounded cache takes its prompt in one chunk (`whole_prompt_tokens`)."""
        return budget is not None and not policy.needs_attention and 0 < prompt_left <= self.whole_prompt_tokens

    def _evicting_chunk(self, budget: int | None) -> int:
        # A bounded cache that evicts while prefilling takes at most max(budget, min_bounded_chunk)
        # tokens per chunk, so no query sees more than budget cached + that many new tokens (with the
        # default floor of 1: budget + budget). The service raises the floor
        # (`min_prefill_chunk_tokens`): a 16-slot budget would otherwise prefill a 100-token chat in
        # seven calls; the cache it keeps is still `budget` slots.
        if budget is None:
            return self.prefill_chunk
        return min(self.prefill_chunk, max(budget, self.min_bounded_chunk))

    def warm_prefix(self, prompt_ids: list[int], cache: CacheConfig) -> int:
        """Prefill a common prompt beginning alone and keep its cache state, so that requests of this
        cache configuration whose prompt starts with it begin from a copy (`kvpop.cache.prefix_cache`
        says what that equals). A bounded policy keeps the longest part that fills whole prefill
        chunks, where a cold prefill stands at a chunk boundary too. Returns the tokens kept (0: not
        one whole chunk). Call it before `step` runs (it uses the step thread's cache manager)."""
        if cache.compression is not None:
            raise ValueError("a warm prefix needs a fixed budget: a compression ratio's budget depends on each request")
        budget = cache.resolve_budget(len(prompt_ids), 0)
        if self.prefills_whole(cache.build_policy(self.learned_scorers), budget, len(prompt_ids)):
            return 0  # a cold prefill would take prefix and rest as one chunk: no state to start it from
        chunk = self._evicting_chunk(budget)
        keep = len(prompt_ids) if budget is None else len(prompt_ids) // chunk * chunk
        if keep == 0:
            return 0
        request = GenerationRequest(f"warm-prefix:{len(self.cache_manager.prefixes)}", prompt_ids[:keep], SamplingParams(max_tokens=1), cache)
        self._check(request)
        sequence = self._new_sequence(request)
        self._feed_prompt(sequence)
        self.cache_manager.save_prefix(sequence.cache, request.prompt_ids, cache)
        self.cache_manager.free(request.request_id)
        return keep

    def close_session(self, session_id: str) -> bool:
        """Forget a session's saved state (memory and disk); whether there was one."""
        return self.cache_manager.close_session(session_id)

    def _keep_session(self, sequence: _Sequence) -> None:
        """Save a finished turn's cache and the tokens it has seen (all but the last sampled one)."""
        cache, request = sequence.cache, sequence.request
        history = (request.prompt_ids + sequence.output_ids)[: cache.tokens_seen]
        self.cache_manager.save_session(request.session_id, cache, history, request.cache)

    def _decode_and_prefill(self, decoding: list[_Sequence]) -> list[TokenEvent]:
        """This step's model work: one decode step of the running sequences, and admitted prompts fed
        under the step's token budget: `max_step_tokens` while streams decode (the longest a running
        stream waits for prompt work between two of its tokens), at least one whole `prefill_chunk`
        when none does. The budget stands even if every decoded stream just finished: their last
        tokens leave with this step's events, so they wait too.

        In rounds: each round takes, first come first served, the next piece of every prompt: the rest
        of its current chunk, cut to what is left of the budget. A chunk cut in pieces still enters its
        cache once, whole (kvpop.cache.staged_chunk), so answers do not depend on the load. Pieces of
        equal length run as one call, and the first such call takes the decode step along (the mixed
        step: the weights are read once for both) when the export has it and no cache in either reads
        attention. A prompt whose last chunk went in samples its first token."""
        if not decoding:
            budget = max(self.max_step_tokens, self.prefill_chunk)
        else:
            budget = self.max_step_tokens if self.pacer is None else self.pacer.step_tokens(self.max_step_tokens)
        mixed = bool(decoding) and self.decoder.has_mixed_step and not self._reads_attention(decoding)
        events = self._decode(decoding) if decoding and not mixed else []
        decode_events: list[TokenEvent] = []
        used, started = 0, time.perf_counter()
        while self._prefilling and used < budget:
            pieces: dict[int, list[_Sequence]] = {}  # piece length -> sequences (one batched call each)
            for sequence in self._prefilling.values():
                length = min(sequence.chunk_left, budget - used)
                if length <= 0 or used and length < min(sequence.chunk_left, MIN_PIECE_TOKENS):
                    break  # no sliver of a chunk after other work: a call costs more than its tokens
                pieces.setdefault(length, []).append(sequence)
                used += length
            if not pieces:  # what is left of the budget is too small to start any piece
                break
            for length, sequences in pieces.items():
                if mixed and not self._reads_attention(sequences):
                    decode_events, out = self._run_mixed(decoding, sequences, length)
                    mixed = False
                else:
                    out = self._run_piece(sequences, length)
                for row, sequence in enumerate(sequences):
                    if sequence.prompt_left == 0:
                        sequence.pending_token = sequence.sampler(out.logits[row, -1])
                        del self._prefilling[sequence.request.request_id]
                        self._running[sequence.request.request_id] = sequence
                        events.append(self._accept(sequence, sequence.pending_token))
        if self.pacer is not None and decoding and used:
            prompt_seconds = time.perf_counter() - started
            if decode_events and self.pacer.decode_seconds is not None:  # the decode shared a call: its usual share
                prompt_seconds -= self.pacer.decode_seconds
            self.pacer.observe_prefill(prompt_seconds, used)
        if mixed:  # no prompt piece to share the call with
            decode_events = self._decode(decoding)
        return decode_events + events

    @staticmethod
    def _reads_attention(sequences: list[_Sequence]) -> bool:
        return any(sequence.cache.policy.needs_attention for sequence in sequences)

    def _run_piece(self, sequences: list[_Sequence], length: int) -> StepOutput:
        """The next `length` prompt tokens of each sequence (at most the rest of its current chunk)
        through one decoder call, after its cache and its chunk's staged pieces. A sequence whose chunk
        this completes has it appended to its cache; otherwise the piece is staged."""
        out = self.decoder.run(*self._piece_inputs(sequences, length), last_only=True, attention=self._reads_attention(sequences))
        self._store_piece(sequences, length, out)
        return out

    def _run_mixed(self, decoding: list[_Sequence], sequences: list[_Sequence], length: int) -> tuple[list[TokenEvent], StepOutput]:
        """The decode step of `decoding` and a prompt piece of `sequences` in one (mixed) decoder call."""
        decode_out, piece_out = self.decoder.run_mixed(self._decode_inputs(decoding), self._piece_inputs(sequences, length))
        self._store_piece(sequences, length, piece_out)
        return self._store_decode(decoding, decode_out), piece_out

    def _piece_inputs(self, sequences: list[_Sequence], length: int) -> StepInputs:
        caches = [sequence.cache for sequence in sequences]
        starts = [sequence.prefilled for sequence in sequences]
        input_ids = np.array([sequence.request.prompt_ids[start : start + length] for sequence, start in zip(sequences, starts)], np.int64)
        positions = np.array([np.arange(start, start + length) for start in starts], np.int64)  # (B, T)
        past_key, past_value, slot_mask = self.cache_manager.prefill_inputs(caches, [sequence.staged for sequence in sequences])
        return StepInputs(input_ids, positions, past_key, past_value, slot_mask)

    def _store_piece(self, sequences: list[_Sequence], length: int, out: StepOutput) -> None:
        caches = [sequence.cache for sequence in sequences]
        staged = [sequence.staged for sequence in sequences]
        chunk_lengths = [(0 if sequence.staged is None else sequence.staged.length) + sequence.chunk_left for sequence in sequences]
        for sequence, piece in zip(sequences, self.cache_manager.store_pieces(caches, staged, chunk_lengths, out)):
            sequence.staged = piece
            sequence.prefilled += length

    def _prefill(self, request: GenerationRequest) -> _Sequence:
        """A request's whole prompt fed alone, chunk by chunk, with token 1 sampled (benchmarks)."""
        sequence = self._new_sequence(request)
        out = self._feed_prompt(sequence)
        sequence.pending_token = sequence.sampler(out.logits[0, -1])
        return sequence

    def _feed_prompt(self, sequence: _Sequence) -> StepOutput:
        """The rest of one sequence's prompt, alone, chunk by chunk; the last chunk's output."""
        while sequence.prompt_left:
            out = self._run_piece([sequence], sequence.chunk_left)
        return out

    def _decode(self, sequences: list[_Sequence]) -> list[TokenEvent]:
        """One decode step of `sequences` in its own decoder call."""
        started = time.perf_counter()
        out = self.decoder.run(*self._decode_inputs(sequences), last_only=True, attention=self._reads_attention(sequences))
        events = self._store_decode(sequences, out)
        if self.pacer is not None:  # a decode step alone: what the prefill pacer sizes prompt work by
            self.pacer.observe_decode(time.perf_counter() - started)
        return events

    def _decode_inputs(self, sequences: list[_Sequence]) -> StepInputs:
        caches = [sequence.cache for sequence in sequences]
        past_key, past_value, slot_mask = self.cache_manager.decode_inputs(caches)  # the pool's arrays, no copy
        input_ids = np.array([[sequence.pending_token] for sequence in sequences], dtype=np.int64)  # (B, 1)
        positions = np.array([[cache.tokens_seen] for cache in caches], dtype=np.int64)  # (B, 1)
        return StepInputs(input_ids, positions, past_key, past_value, slot_mask)

    def _store_decode(self, sequences: list[_Sequence], out: StepOutput) -> list[TokenEvent]:
        """Append the decode step's new tokens and sample the next ones."""
        self.cache_manager.store_decode([sequence.cache for sequence in sequences], out)
        return [self._accept(sequence, sequence.sampler(out.logits[row, -1])) for row, sequence in enumerate(sequences)]

    def _accept(self, sequence: _Sequence, token: int) -> TokenEvent:
        """Record a sampled token and decide whether the sequence ends with it."""
        sequence.output_ids.append(token)
        sequence.pending_token = token
        sampling = sequence.request.sampling
        if token in self.spec.eos_token_ids and not sampling.ignore_eos:
            return self._finish(sequence, FinishReason.STOP, token)
        if sampling.stop:
            sequence.matched_stop = self._matched_stop(sequence.output_ids, sampling.stop)
            if sequence.matched_stop is not None:
                return self._finish(sequence, FinishReason.STOP, token)
        if len(sequence.output_ids) >= sampling.max_tokens or sequence.cache.tokens_seen + 1 >= self.spec.max_position_embeddings:
            return self._finish(sequence, FinishReason.LENGTH, token)
        return TokenEvent(sequence.request.request_id, token, finished=False, finish_reason=None)

    def _matched_stop(self, output_ids: list[int], stops: tuple[str, ...]) -> str | None:
        # A stop string is completed by the newest token; decoding a short tail is enough to see it
        # (every token decodes to at least one byte; a character is at most 4 bytes).
        tail = output_ids[-(4 * max(len(stop) for stop in stops) + 4) :]
        text = self.tokenizer.decode(tail, skip_special_tokens=True)
        return next((stop for stop in stops if stop in text), None)

    def _finish(self, sequence: _Sequence, reason: FinishReason, token: int) -> TokenEvent:
        cache, request = sequence.cache, sequence.request
        self._running.pop(request.request_id, None)
        self._prefilling.pop(request.request_id, None)
        result = GenerationResult(
            request_id=request.request_id,
            prompt_ids=request.prompt_ids,
            output_ids=sequence.output_ids,
            finish_reason=reason,
            budget=cache.budget if cache.budget is not None else cache.length,
            peak_kv_bytes=cache.peak_bytes,
            tokens_evicted=cache.tokens_evicted,
            compression=cache.tokens_evicted / cache.tokens_seen if cache.tokens_seen else 0.0,
            tokens_seen=cache.tokens_seen,
            policy=request.cache.policy,
            matched_stop=sequence.matched_stop,
            tokens_reused=sequence.allocation.tokens_reused,
            session_tier=sequence.allocation.session_tier,
            prefix_lookup=sequence.allocation.prefix_lookup,
            prefix_tokens_reused=sequence.allocation.prefix_tokens_reused,
        )
        if request.session_id is not None and request.end_session:
            self.close_session(request.session_id)
        elif request.session_id is not None and reason != FinishReason.CANCELLED:
            self._keep_session(sequence)
        self.cache_manager.free(request.request_id)
        with self._lock:
            self._finished[request.request_id] = result
        return TokenEvent(request.request_id, token, finished=True, finish_reason=reason)

    def _finish_waiting(self, request: GenerationRequest) -> TokenEvent:
        """A request cancelled before it started (called under the lock)."""
        self._finished[request.request_id] = GenerationResult(
            request.request_id, request.prompt_ids, [], FinishReason.CANCELLED, budget=0, peak_kv_bytes=0,
            tokens_evicted=0, compression=0.0, policy=request.cache.policy,
        )
        return TokenEvent(request.request_id, NO_TOKEN, finished=True, finish_reason=FinishReason.CANCELLED)


__all__ = [
    "CacheConfig",
    "Engine",
    "GenerationRequest",
    "GenerationResult",
    "SamplingParams",
    "TokenEvent",
]
