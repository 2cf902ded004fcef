"""The engine worker: one thread that drives the engine, in-flight batching every request it is given.

Why a thread: Triton calls `execute` with whatever requests have arrived; a decoupled model returns
at once and answers later through each request's response sender. The worker is the bridge: it hands
each request to the engine (whose scheduler queues it and admits it by KV memory), steps the engine,
streams tokens (or sends one final answer) as each step produces them, and cancels in the engine what a
client left, so its slots are freed within one step.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

import numpy as np

from kvpop.engine import Engine
from kvpop.engine.admission import OverloadedError
from kvpop.request import NO_TOKEN, TokenEvent
from kvpop.serving.contract import ErrorKind
from kvpop.serving.process.drain import DrainSignal
from kvpop.serving.kvpop_engine.metrics import NullMetrics, SequenceCounts
from kvpop.serving.kvpop_engine.parse import InvalidRequestError, ParsedRequest
from kvpop.serving.kvpop_engine.responses import output_tensors


class ResponseChannel(Protocol):
    """Where one request's responses go (a Triton response sender in production)."""

    def send(self, tensors: dict[str, np.ndarray], final: bool) -> None: ...

    def send_error(self, message: str, kind: ErrorKind) -> None: ...

    def is_cancelled(self) -> bool: ...


@dataclass
class _Active:
    """A request the engine holds (waiting, prefilling or decoding) and where its answer goes."""

    parsed: ParsedRequest
    channel: ResponseChannel
    arrived: float = field(default_factory=time.perf_counter)
    cancel_checked_at: float = 0.0  # perf_counter of the last is_cancelled() (an IPC round trip in Triton)
    generated: int = 0  # tokens generated so far
    first_token_at: float | None = None
    cancel_sent: bool = False


class EngineWorker:
    def __init__(
        self,
        engine_factory: Callable[[], Engine],
        tokenizer,
        metrics=None,
        idle_wait: float = 0.05,
        drain: DrainSignal | None = None,
        cancel_check_interval: float = 0.05,
    ) -> None:
        self._engine_factory = engine_factory
        self.engine = engine_factory()
        self.tokenizer = tokenizer
        self.metrics = metrics or NullMetrics()
        self._idle_wait = idle_wait
        # is_cancelled() costs a round trip to the Triton parent: ask each request at most this often
        # (a cancelled request's slots are freed within this interval plus one step).
        self._cancel_check_interval = cancel_check_interval
        self.drain = drain or DrainSignal(None)
        self._condition = threading.Condition()
        self._submitted: dict[str, _Active] = {}  # guarded by _condition: given to the engine since the last step
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
        """Hand a request to the engine. Raises OverloadedError when too many wait for KV memory,
        InvalidRequestError when the engine refuses it (it can never fit this instance's KV pool...)."""
        if self.drain.draining:
            raise OverloadedError("the server is shutting down; retry on another replica")
        with self._condition:
            try:
                self.engine.add_request(parsed.generation)
            except ValueError as error:
                raise InvalidRequestError(str(error)) from None
            self._submitted[parsed.generation.request_id] = _Active(parsed, channel)
            self._condition.notify()

    @property
    def num_queued(self) -> int:
        """Requests waiting for KV memory."""
        return self.engine.scheduler.waiting.waiting_for_memory

    @property
    def num_active(self) -> int:
        return len(self._active) + len(self._submitted)

    # -- the worker thread -------------------------------------------------------------------------
    def _run(self) -> None:
        while self._wait_for_work():
            self._step()
        self._shut_down()

    def _wait_for_work(self) -> bool:
        """Block until there is something to do; False once stopping. Holds no request while it
        waits: a decoupled model cannot unload while a response sender is still referenced."""
        with self._condition:
            while not self._stopping and not self._submitted and not self._active:
                self._condition.wait()
            return not self._stopping

    def _take_submitted(self) -> None:
        with self._condition:
            self._active.update(self._submitted)
            self._submitted = {}

    def _step(self) -> None:
        self._take_submitted()
        if self.drain.deadline_passed() and self._active:
            self._give_up_on_everything("the server is shutting down and its grace period is over; retry")
        self._apply_cancellations()
        try:
            events = self.engine.step()
        except Exception as error:  # never take the server down: fail the running requests
            self._fail_running(f"engine step failed: {type(error).__name__}: {error}")
            return
        self._take_submitted()  # an event may already answer a request submitted while the step began
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
        state = self.engine.state()  # its `waiting`: for KV memory, or for a place in the running batch
        self.metrics.observe_step(
            batch_size=sum(1 for event in events if event.token_id != NO_TOKEN),  # sequences that got a token
            kv_bytes_in_use=in_use,
            kv_bytes_reserved=self.engine.cache_manager.reserved_bytes,
            sequences=SequenceCounts(queued=len(state.waiting), prefilling=len(state.prefilling), decoding=len(state.decoding)),
        )
        if not events and not self.engine.num_running:
            # Only requests waiting for KV memory: nothing to compute until one finishes or leaves.
            # (A step that fed a prompt chunk yields no event either, and must not wait: that wait,
            # once per chunk, was most of a long prompt's time to first token through the server.)
            time.sleep(self._idle_wait)

    def _shut_down(self) -> None:
        """Answer everything still held, so no client waits on a model that is gone."""
        self._take_submitted()
        self._give_up_on_everything("the model is shutting down; retry on another instance")
        try:
            self.engine.step()  # the cancellations free their slots and KV reservations
        except Exception:
            pass

    def _give_up_on_everything(self, message: str) -> None:
        """Fail every waiting and running request as UNAVAILABLE (retryable) and free its slots."""
        for request_id in list(self._active):
            self.engine.cancel(request_id)
            self._finish_with_error(request_id, message, ErrorKind.OVERLOADED)

    def _client_left(self, active: _Active, now: float) -> bool:
        """Whether the request was cancelled, asking at most every cancel_check_interval."""
        if now - active.cancel_checked_at < self._cancel_check_interval:
            return False
        active.cancel_checked_at = now
        return active.channel.is_cancelled()

    def _apply_cancellations(self) -> None:
        """Cancel in the engine what its clients left: waiting for a place in the batch, prefilling or decoding."""
        now = time.perf_counter()
        for request_id, active in self._active.items():
            if not active.cancel_sent and self._client_left(active, now):
                self.engine.cancel(request_id)
                active.cancel_sent = True

    def _dispatch(self, event: TokenEvent) -> None:
        active = self._active.get(event.request_id)
        if active is None:  # failed or given up already: only its result is left to release
            if event.finished:
                self.engine.result(event.request_id)
            return
        now = time.perf_counter()
        parsed = active.parsed
        if event.token_id != NO_TOKEN:
            active.generated += 1
            if active.first_token_at is None:
                active.first_token_at = now
                self.metrics.observe_first_token(now - active.arrived)
        if not event.finished:
            if parsed.stream:
                tensors = output_tensors(event.text, [event.token_id], None, len(parsed.generation.prompt_ids),
                                         active.generated)
                try:
                    active.channel.send(tensors, final=False)
                except Exception:  # the client went away: free its slots at the next step
                    self.engine.cancel(event.request_id)
                    active.cancel_sent = True
            return
        del self._active[event.request_id]
        result = self.engine.result(event.request_id)
        if not result.started:  # cancelled while it waited: it never took compute
            self.metrics.observe_cancelled_in_queue()
            self._send_final(active, output_tensors("", [], "cancelled", len(result.prompt_ids), 0))
            return
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
        self.metrics.observe_finished(result, now - active.arrived, time_per_token, len(result.prompt_ids))
        if result.degraded_from is not None:
            self.metrics.observe_degraded()
        if parsed.generation.session_id is not None:
            self.metrics.observe_session_turn(len(result.prompt_ids), result.tokens_reused)
        if result.prefix_lookup:
            self.metrics.observe_prefix_lookup(len(result.prompt_ids), result.prefix_tokens_reused)
        self._send_final(active, tensors)

    @staticmethod
    def _send_final(active: _Active, tensors: dict[str, np.ndarray]) -> None:
        try:
            active.channel.send(tensors, final=True)
        except Exception:  # the client went away; its slots are already free
            pass

    def _finish_with_error(self, request_id: str, message: str, kind: ErrorKind) -> None:
        """Answer a request with an error; the engine has cancelled it, or is given up."""
        active = self._active.pop(request_id)
        self.metrics.observe_rejected(kind)
        try:
            active.channel.send_error(message, kind)
        except Exception:
            pass

    def _fail_running(self, message: str) -> None:
        """The engine failed: its running requests fail with it, its waiting ones move to a new engine
        (`Engine.abandon` releases the KV reservations of both first)."""
        with self._condition:
            failed, self.engine = self.engine, self._engine_factory()
            waiting = failed.abandon()
            for pending in waiting:
                try:
                    self.engine.add_request(pending.request)
                except (ValueError, OverloadedError) as error:
                    self._finish_with_error(pending.request_id, str(error), ErrorKind.OVERLOADED)
        moved = {pending.request_id for pending in waiting}
        for request_id in [request_id for request_id in self._active if request_id not in moved]:
            self._finish_with_error(request_id, message, ErrorKind.INTERNAL)
