"""The engine worker: one thread that drives the engine, in-flight batching every request it is given.

Why a thread: Triton calls `execute` with whatever requests have arrived; a decoupled model returns
at once and answers later through each request's response sender. The worker admits requests by KV
memory, joins them to the running batch at the next step, streams tokens (or sends one final answer)
as each step produces them, and frees a cancelled request's slots within one step.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Protocol

import numpy as np

from kvpop.engine import Engine
from kvpop.request import NO_TOKEN, TokenEvent
from kvpop.serving.admission import Admission, KVPoolAdmission, OverloadedError
from kvpop.serving.contract import ErrorKind
from kvpop.serving.drain import DrainSignal
from kvpop.serving.metrics import NullMetrics, SequenceCounts
from kvpop.serving.request import InvalidRequestError, ParsedRequest
from kvpop.serving.responses import output_tensors


class ResponseChannel(Protocol):
    """Where one request's responses go (a Triton response sender in production)."""

    def send(self, tensors: dict[str, np.ndarray], final: bool) -> None: ...

    def send_error(self, message: str, kind: ErrorKind) -> None: ...

    def is_cancelled(self) -> bool: ...


@dataclass
class _Pending:
    parsed: ParsedRequest
    channel: ResponseChannel
    prefill_slots: int = 0  # what its prefill holds beyond its cache until its first token (CacheManager.prefill_slots)
    arrived: float = field(default_factory=time.perf_counter)
    cancel_checked_at: float = 0.0  # perf_counter of the last is_cancelled() (an IPC round trip in Triton)


@dataclass
class _Active:
    pending: _Pending
    admission: Admission
    generated: int = 0  # tokens generated so far
    first_token_at: float | None = None
    cancel_sent: bool = False


class EngineWorker:
    def __init__(
        self,
        engine_factory: Callable[[], Engine],
        tokenizer,
        admission: KVPoolAdmission,
        metrics=None,
        idle_wait: float = 0.05,
        drain: DrainSignal | None = None,
        cancel_check_interval: float = 0.05,
    ) -> None:
        self._engine_factory = engine_factory
        self.engine = engine_factory()
        self.tokenizer = tokenizer
        self.admission = admission
        self.metrics = metrics or NullMetrics()
        self._idle_wait = idle_wait
        # is_cancelled() costs a round trip to the Triton parent: ask each request at most this often
        # (a cancelled request's slots are freed within this interval plus one step).
        self._cancel_check_interval = cancel_check_interval
        self.drain = drain or DrainSignal(None)
        self._condition = threading.Condition()
        # Guarded by _condition: requests waiting for KV memory (FIFO), admitted ones not yet started,
        # and the cache manager's reservations (Triton threads admit in `submit`).
        self._queue: deque[_Pending] = deque()
        self._ready: list[_Active] = []
        self._active: dict[str, _Active] = {}  # worker thread only
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="kvpop-engine", daemon=True)

    # -- called from Triton's threads --------------------------------------------------------------
    def start(self) -> "EngineWorker":
        self._thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        with self._condition:
            self._stopping = True
            self._condition.notify_all()
        self._thread.join(timeout)

    def submit(self, parsed: ParsedRequest, channel: ResponseChannel) -> None:
        """Admit a request now if the KV pool has room, else queue it. Raises OverloadedError when the
        queue is full, InvalidRequestError if it can never fit this instance's KV pool."""
        if self.drain.draining:
            raise OverloadedError("the server is shutting down; retry on another replica")
        manager = self.engine.cache_manager
        if not self.admission.fits_when_idle(manager, parsed.generation):
            raise InvalidRequestError(
                f"request needs {manager.slots_needed(parsed.generation)} KV slots per head, more "
                f"than this instance's KV pool holds; lower max_tokens or choose a bounded eviction_policy"
            )
        pending = _Pending(parsed, channel, manager.prefill_slots(parsed.generation))
        with self._condition:
            admission = None if self._queue else self.admission.try_admit(manager, parsed.generation, pending.prefill_slots)
            if admission is not None:
                self._ready.append(self._activate(pending, admission))
            elif len(self._queue) >= self.admission.policy.max_queue_size:
                raise OverloadedError(
                    f"overloaded: {len(self._queue)} requests already waiting for KV memory; retry later"
                )
            else:
                self._queue.append(pending)
            self._condition.notify()

    @property
    def num_queued(self) -> int:
        return len(self._queue)

    @property
    def num_active(self) -> int:
        return len(self._active)

    # -- the worker thread -------------------------------------------------------------------------
    def _run(self) -> None:
        while self._wait_for_work():
            self._step()
        self._shut_down()

    def _wait_for_work(self) -> bool:
        """Block until there is something to do; False once stopping. Holds no request while it
        waits: a decoupled model cannot unload while a response sender is still referenced."""
        with self._condition:
            while not self._stopping and not self._queue and not self._ready and not self._active:
                self._condition.wait()
            return not self._stopping

    def _step(self) -> None:
        with self._condition:
            left = self._take_cancelled_locked()
            admitted = self._ready + self._admit_locked()
            self._ready = []
        for pending in left:
            self.metrics.observe_cancelled_in_queue()
            try:
                prompt_tokens = len(pending.parsed.generation.prompt_ids)
                pending.channel.send(output_tensors("", [], "cancelled", prompt_tokens, 0), final=True)
            except Exception:  # the client is gone
                pass
        for active in admitted:
            self._start(active)
        if self.drain.deadline_passed() and (self._active or self._queue):
            self._give_up_on_everything("the server is shutting down and its grace period is over; retry")
        self._apply_cancellations()
        try:
            events = self.engine.step()
        except Exception as error:  # never take the server down: fail the running requests
            self._fail_all(f"engine step failed: {type(error).__name__}: {error}")
            return
        for event in events:
            try:
                self._dispatch(event)
            except Exception as error:  # a bug answering one request must not stop the others
                if event.request_id in self._active:
                    self.engine.cancel(event.request_id)
                    self._finish_with_error(event.request_id, f"internal error: {error}", ErrorKind.INTERNAL)
        in_use = self.engine.cache_manager.observe_in_use()  # the hot session tier lives in the KV pool too
        if self.engine.sessions is not None:
            self.metrics.observe_sessions(self.engine.sessions)
        with self._condition:  # not started: waiting for KV memory, or admitted since this step began
            reserved, queued = self.engine.cache_manager.reserved_bytes, len(self._queue) + len(self._ready)
        state = self.engine.state()  # its `waiting`: KV memory reserved, no place in the running batch yet
        self.metrics.observe_step(
            batch_size=sum(1 for event in events if event.token_id != NO_TOKEN),  # sequences that got a token
            kv_bytes_in_use=in_use,
            kv_bytes_reserved=reserved,
            sequences=SequenceCounts(queued=queued + len(state.waiting), prefilling=len(state.prefilling),
                                     decoding=len(state.decoding)),
        )
        if not events and not self.engine.num_running:
            # Only requests waiting for KV memory: nothing to compute until one finishes or leaves.
            # (A step that fed a prompt chunk yields no event either, and must not wait: that wait,
            # once per chunk, was most of a long prompt's time to first token through the server.)
            time.sleep(self._idle_wait)

    def _shut_down(self) -> None:
        """Answer everything still held, so no client waits on a model that is gone."""
        self._give_up_on_everything("the model is shutting down; retry on another instance")

    def _give_up_on_everything(self, message: str) -> None:
        """Fail every queued and running request as UNAVAILABLE (retryable) and free its slots."""
        with self._condition:
            waiting = [pending.channel for pending in self._queue] + [active.pending.channel for active in self._ready]
            for active in self._ready:
                self.engine.cache_manager.release(active.admission.request.request_id)
            self._queue.clear()
            self._ready = []
        for channel in waiting:
            try:
                channel.send_error(message, ErrorKind.OVERLOADED)
            except Exception:
                pass
        for request_id in list(self._active):
            self.engine.cancel(request_id)
            self._finish_with_error(request_id, message, ErrorKind.OVERLOADED)

    def _take_cancelled_locked(self) -> list[_Pending]:
        """Remove the queued requests whose client went away: they never take KV memory or compute."""
        now, kept, left = time.perf_counter(), deque(), []
        for pending in self._queue:
            (left if self._client_left(pending, now) else kept).append(pending)
        self._queue = kept
        return left

    def _client_left(self, pending: _Pending, now: float) -> bool:
        """Whether the request was cancelled, asking at most every cancel_check_interval."""
        if now - pending.cancel_checked_at < self._cancel_check_interval:
            return False
        pending.cancel_checked_at = now
        return pending.channel.is_cancelled()

    def _admit_locked(self) -> list[_Active]:
        """Move queue-head requests that fit the KV pool into the engine (FIFO: no overtaking)."""
        admitted = []
        while self._queue:
            pending = self._queue[0]
            admission = self.admission.try_admit(self.engine.cache_manager, pending.parsed.generation, pending.prefill_slots)
            if admission is None:
                break
            self._queue.popleft()
            admitted.append(self._activate(pending, admission))
        return admitted

    def _activate(self, pending: _Pending, admission: Admission) -> _Active:
        if admission.degraded_from is not None:
            self.metrics.observe_degraded()
        return _Active(pending, admission)

    def _release(self, request_id: str) -> None:
        with self._condition:
            self.engine.cache_manager.release(request_id)

    def _start(self, active: _Active) -> None:
        request = active.admission.request
        try:
            self.engine.add_request(request)
        except ValueError as error:
            self._release(request.request_id)
            self.metrics.observe_rejected(ErrorKind.INVALID)
            try:
                active.pending.channel.send_error(str(error), ErrorKind.INVALID)
            except Exception:  # the client is gone
                pass
            return
        self._active[request.request_id] = active

    def _apply_cancellations(self) -> None:
        """Cancel in the engine what its clients left: waiting for a place in the batch, prefilling or decoding."""
        now = time.perf_counter()
        for request_id, active in self._active.items():
            if not active.cancel_sent and self._client_left(active.pending, now):
                self.engine.cancel(request_id)
                active.cancel_sent = True

    def _dispatch(self, event: TokenEvent) -> None:
        active = self._active.get(event.request_id)
        if active is None:  # failed or given up already: only its result is left to release
            if event.finished:
                self.engine.result(event.request_id)
            return
        now = time.perf_counter()
        parsed = active.pending.parsed
        if event.token_id != NO_TOKEN:
            active.generated += 1
            if active.first_token_at is None:
                active.first_token_at = now
                self.metrics.observe_first_token(now - active.pending.arrived)
                with self._condition:
                    self.engine.cache_manager.prefill_done(event.request_id)
        if not event.finished:
            if parsed.stream:
                tensors = output_tensors(event.text, [event.token_id], None, len(parsed.generation.prompt_ids),
                                         active.generated)
                try:
                    active.pending.channel.send(tensors, final=False)
                except Exception:  # the client went away: free its slots at the next step
                    self.engine.cancel(event.request_id)
                    active.cancel_sent = True
            return
        del self._active[event.request_id]
        self._release(event.request_id)
        result = self.engine.result(event.request_id)
        if parsed.stream:
            ids = [event.token_id] if event.token_id != NO_TOKEN else []
            tensors = output_tensors(event.text, ids, result.finish_reason, len(result.prompt_ids), len(result.output_ids), result)
        else:
            ids, text = list(result.output_ids), result.text  # the text ends before a stop string; the ids count every token
            if parsed.echo_prompt:  # exclude_input_in_output=false (TensorRT-LLM): prompt, then answer
                ids = list(result.prompt_ids) + ids
                text = self.tokenizer.decode(result.prompt_ids, skip_special_tokens=True) + text
            tensors = output_tensors(text, ids, result.finish_reason, len(result.prompt_ids), len(result.output_ids), result)
        generated = len(result.output_ids)
        time_per_token = (now - active.first_token_at) / (generated - 1) if active.first_token_at and generated > 1 else None
        self.metrics.observe_finished(result, now - active.pending.arrived, time_per_token, len(result.prompt_ids))
        if parsed.generation.session_id is not None:
            self.metrics.observe_session_turn(len(result.prompt_ids), result.tokens_reused)
        if result.prefix_lookup:
            self.metrics.observe_prefix_lookup(len(result.prompt_ids), result.prefix_tokens_reused)
        try:
            active.pending.channel.send(tensors, final=True)
        except Exception:  # the client went away; its slots are already free
            pass

    def _finish_with_error(self, request_id: str, message: str, kind: ErrorKind) -> None:
        active = self._active.pop(request_id)
        self._release(request_id)
        self.metrics.observe_rejected(kind)
        try:
            active.pending.channel.send_error(message, kind)
        except Exception:
            pass

    def _fail_all(self, message: str) -> None:
        for request_id in list(self._active):
            self._finish_with_error(request_id, message, ErrorKind.INTERNAL)
        self.engine = self._engine_factory()
