"""The engine worker without Triton: a real engine on the tiny model, answering into in-memory channels."""

from __future__ import annotations

import inspect
import threading
import time
from dataclasses import replace

import numpy as np
import pytest

from kvpop.decoder import DecoderStep
from kvpop.engine import Engine, EngineConfig
from kvpop.request import CacheConfig, GenerationRequest, SamplingParams
from kvpop.model_spec import ModelSpec
from kvpop.cache.manager import CacheManager
from kvpop.cache.reservations import KVReservations
from kvpop.engine.admission import OverloadedError
from kvpop.serving.contract import ErrorKind
from kvpop.serving.kvpop_engine.metrics import NullMetrics, SequenceCounts
from kvpop.serving.kvpop_engine.parse import ParsedRequest
from kvpop.serving.kvpop_engine.worker import EngineWorker


class ListChannel:
    """Collects one request's responses; `cancel()` plays a client that goes away."""

    def __init__(self) -> None:
        self.responses: list[dict] = []
        self.errors: list[tuple[str, str]] = []
        self.done = threading.Event()
        self.cancelled = False

    def send(self, tensors, final):
        self.responses.append(tensors)
        if final:
            self.done.set()

    def send_error(self, message, kind):
        self.errors.append((message, kind))
        self.done.set()

    def is_cancelled(self):
        return self.cancelled

    def ids(self) -> list[int]:
        return [int(token) for response in self.responses for token in response["output_ids"].reshape(-1)]


@pytest.fixture
def worker(tiny_onnx_model_dir):
    from transformers import AutoTokenizer

    decoder = DecoderStep(tiny_onnx_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_onnx_model_dir / "tokenizer")
    spec = ModelSpec.load(tiny_onnx_model_dir)
    pool = KVReservations(1024 * spec.kv_bytes_per_token, spec)
    config = EngineConfig(min_kv_budget=64, max_queue_size=1)
    worker = EngineWorker(lambda: Engine(decoder, config, tokenizer=tokenizer, reservations=pool), tokenizer, idle_wait=0.01).start()
    yield worker
    worker.stop()


def parsed(request_id: str, stream: bool, max_tokens: int = 8, budget: int | None = None, ignore_eos: bool = False):
    cache = CacheConfig("streaming", budget=budget) if budget else CacheConfig()
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos)
    return ParsedRequest(GenerationRequest(request_id, list(range(5, 25)), sampling, cache), stream=stream)


def test_streamed_and_complete_answers_carry_the_same_tokens(worker):
    streamed, complete = ListChannel(), ListChannel()
    worker.submit(parsed("a", stream=True), streamed)
    worker.submit(parsed("b", stream=False), complete)
    assert streamed.done.wait(30) and complete.done.wait(30)
    assert len(streamed.responses) == 8 and len(complete.responses) == 1
    assert streamed.ids() == complete.ids()
    assert complete.responses[0]["finish_reason"][0, 0] == b"length"
    assert worker.engine.cache_manager.reserved_bytes == 0
    # A streamed token carries its text, token and counts; the cache statistics come with the last
    # response only, as in a complete answer (README: outputs).
    core = {"text_output", "output_ids", "finish_reason", "num_input_tokens", "num_output_tokens"}
    assert all(set(response) == core for response in streamed.responses[:-1])
    assert set(streamed.responses[-1]) == set(complete.responses[0]) > core
    assert streamed.responses[-1]["kv_budget"][0, 0] == complete.responses[0]["kv_budget"][0, 0] > 0


def test_cancel_frees_slots_and_queue_limit_rejects(worker):
    holder = ListChannel()
    worker.submit(parsed("holder", stream=True, max_tokens=60_000, budget=1000, ignore_eos=True), holder)
    while not holder.responses:
        time.sleep(0.01)
    waiting = ListChannel()
    worker.submit(parsed("waiting", stream=False, max_tokens=8, budget=1000), waiting)  # queued: no room
    with pytest.raises(OverloadedError, match="overloaded"):
        worker.submit(parsed("refused", stream=False, budget=1000), ListChannel())
    holder.cancelled = True
    assert holder.done.wait(10) and waiting.done.wait(30)
    assert holder.responses[-1]["finish_reason"][0, 0] == b"cancelled"
    assert len(waiting.ids()) == 8 and worker.engine.cache_manager.reserved_bytes == 0


def test_stopping_answers_every_waiting_request(tiny_onnx_model_dir, worker):
    holder, waiting = ListChannel(), ListChannel()
    worker.submit(parsed("holder", stream=True, max_tokens=60_000, budget=1000, ignore_eos=True), holder)
    while not holder.responses:
        time.sleep(0.01)
    worker.submit(parsed("waiting", stream=False, budget=1000), waiting)
    worker.stop()
    assert holder.errors and waiting.errors
    assert all("shutting down" in message for message, _ in holder.errors + waiting.errors)
    assert not np.any([worker.num_active, worker.num_queued])


class BrokenChannel(ListChannel):
    """A client whose connection breaks after its first streamed token."""

    def send(self, tensors, final):
        if self.responses:
            raise ConnectionError("client gone")
        super().send(tensors, final)


def test_a_client_that_breaks_mid_stream_is_cancelled_and_others_carry_on(worker):
    broken, healthy = BrokenChannel(), ListChannel()
    worker.submit(parsed("broken", stream=True, max_tokens=60_000, budget=512, ignore_eos=True), broken)
    worker.submit(parsed("healthy", stream=False, max_tokens=8), healthy)
    assert healthy.done.wait(30) and len(healthy.ids()) == 8
    deadline = time.time() + 10
    while worker.num_active and time.time() < deadline:
        time.sleep(0.01)
    assert worker.num_active == 0 and worker.engine.cache_manager.reserved_bytes == 0


class CountingChannel(ListChannel):
    """Counts is_cancelled() calls (each one is an IPC round trip to the Triton parent in production)."""

    def __init__(self) -> None:
        super().__init__()
        self.checks = 0

    def is_cancelled(self):
        self.checks += 1
        return super().is_cancelled()


def test_cancellation_is_checked_at_most_every_interval_not_every_step(worker):
    """A stream of 200 tokens (200 engine steps) is asked whether it was cancelled about once per
    50 ms, not once per step; a cancellation still ends it."""
    channel = CountingChannel()
    started = time.perf_counter()
    worker.submit(parsed("counted", stream=True, max_tokens=200, budget=64, ignore_eos=True), channel)
    assert channel.done.wait(60)
    elapsed = time.perf_counter() - started
    steps = len(channel.responses)
    assert steps == 200
    # Over its wall time T the stream is asked at most once per 50 ms (+1 for the first step), and
    # never more than once per step: a bound that loosens on a slow machine instead of failing.
    assert channel.checks <= min(steps, elapsed / 0.05 + 2)
    cancelled = CountingChannel()
    worker.submit(parsed("cancelled", stream=True, max_tokens=60_000, budget=64, ignore_eos=True), cancelled)
    while not cancelled.responses:
        time.sleep(0.01)
    cancelled.cancelled = True
    assert cancelled.done.wait(10) and cancelled.responses[-1]["finish_reason"][0, 0] == b"cancelled"


def test_a_prompt_fed_in_several_chunks_never_waits_idle(tiny_onnx_model_dir, monkeypatch):
    """Steps that only feed prompt chunks yield no token event; the worker must go straight on to the
    next chunk. The idle wait is for requests waiting on KV memory only (it once cost a long prompt
    one wait per chunk: most of its time to first token through the server)."""
    from transformers import AutoTokenizer

    from kvpop.serving.kvpop_engine import worker as worker_module

    decoder = DecoderStep(tiny_onnx_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_onnx_model_dir / "tokenizer")
    spec = ModelSpec.load(tiny_onnx_model_dir)
    pool = KVReservations(1024 * spec.kv_bytes_per_token, spec)
    idle_waits = []
    real_sleep = time.sleep
    monkeypatch.setattr(worker_module.time, "sleep", lambda seconds: (idle_waits.append(seconds), real_sleep(seconds)))
    worker = EngineWorker(
        lambda: Engine(decoder, EngineConfig(prefill_chunk=8, min_kv_budget=64, max_queue_size=1), tokenizer=tokenizer,
                       reservations=pool), tokenizer, idle_wait=0.01
    ).start()
    try:
        channel = ListChannel()
        request = GenerationRequest("long", list(range(5, 69)), SamplingParams(max_tokens=4, ignore_eos=True))
        worker.submit(ParsedRequest(request, stream=True), channel)  # 64 prompt tokens: 8 chunks of 8
        assert channel.done.wait(30)
        assert len(channel.ids()) == 4 and not channel.errors
        assert idle_waits == []
    finally:
        worker.stop()


def make_worker(model_dir, config: EngineConfig, slots: int, max_queue_size: int, metrics=None) -> EngineWorker:
    from transformers import AutoTokenizer

    decoder = DecoderStep(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir / "tokenizer")
    pool = KVReservations(slots * ModelSpec.load(model_dir).kv_bytes_per_token, ModelSpec.load(model_dir))
    config = replace(config, min_kv_budget=64, max_queue_size=max_queue_size)
    return EngineWorker(lambda: Engine(decoder, config, tokenizer=tokenizer, reservations=pool), tokenizer, metrics,
                        idle_wait=0.01).start()


def test_a_queued_request_whose_client_left_is_dropped_wherever_it_waits(tiny_onnx_model_dir):
    """Behind a queue head that cannot start, a request whose client went away is answered `cancelled` and
    leaves the queue at once: it never takes KV memory; the others are unaffected."""
    worker = make_worker(tiny_onnx_model_dir, EngineConfig(), slots=1024, max_queue_size=2)
    try:
        holder, head, behind = ListChannel(), ListChannel(), ListChannel()
        worker.submit(parsed("holder", stream=True, max_tokens=60_000, budget=1000, ignore_eos=True), holder)
        while not holder.responses:
            time.sleep(0.01)
        worker.submit(parsed("head", stream=False, max_tokens=8, budget=1000), head)
        worker.submit(parsed("behind", stream=False, max_tokens=8, budget=1000), behind)
        assert worker.num_queued == 2
        behind.cancelled = True
        assert behind.done.wait(5) and behind.responses[-1]["finish_reason"][0, 0] == b"cancelled"
        assert worker.num_queued == 1 and not head.done.is_set() and not holder.done.is_set()
        holder.cancelled = True
        assert head.done.wait(30) and len(head.ids()) == 8 and head.responses[0]["finish_reason"][0, 0] == b"length"
    finally:
        worker.stop()


class RecordingMetrics(NullMetrics):
    def __init__(self) -> None:
        self.steps: list[SequenceCounts] = []

    def observe_step(self, batch_size, kv_bytes_in_use, kv_bytes_reserved, sequences) -> None:
        self.steps.append(sequences)


def test_the_sequence_gauges_count_the_running_batch_and_the_waiting_apart(tiny_onnx_model_dir):
    """Five requests that all fit the KV pool, with room for two in the running batch: never more than two
    are active (prefilling or decoding); the rest count as queued, and every request is counted once."""
    metrics = RecordingMetrics()
    worker = make_worker(tiny_onnx_model_dir, EngineConfig(max_batch_size=2), slots=4096, max_queue_size=2,
                         metrics=metrics)
    try:
        channels = [ListChannel() for _ in range(5)]
        for index, channel in enumerate(channels):
            worker.submit(parsed(f"r{index}", stream=True, max_tokens=30, budget=64, ignore_eos=True), channel)
        assert all(channel.done.wait(60) for channel in channels)
    finally:
        worker.stop()
    assert max(counts.active for counts in metrics.steps) == 2
    assert all(counts.active == counts.prefilling + counts.decoding <= 2 for counts in metrics.steps)
    assert max(counts.queued + counts.active for counts in metrics.steps) == 5
    assert metrics.steps[-1] == SequenceCounts(0, 0, 0)


class FinishedResults(NullMetrics):
    def __init__(self) -> None:
        self.results: dict = {}
        self.degraded = 0

    def observe_finished(self, result, latency, time_per_token, prompt_tokens) -> None:
        self.results[result.request_id] = result

    def observe_degraded(self) -> None:
        self.degraded += 1


def test_a_request_is_read_once_and_its_degradation_is_in_its_statistics(tiny_onnx_model_dir, monkeypatch):
    """From the worker through a real engine, a request's budget is resolved and its policy built once: the
    engine reads it into one object that admission, the reservation and the cache allocation share. One the
    tight pool admits at a smaller budget reports the budget it asked for in its result."""
    counts = {"resolve_budget": 0, "build_policy": 0}
    for name in counts:
        method = getattr(CacheConfig, name)

        def counted(self, *args, _method=method, _name=name, **kwargs):
            counts[_name] += 1
            return _method(self, *args, **kwargs)

        monkeypatch.setattr(CacheConfig, name, counted)
    metrics = FinishedResults()
    worker = make_worker(tiny_onnx_model_dir, EngineConfig(), slots=1024, max_queue_size=4, metrics=metrics)
    try:
        holder, squeezed = ListChannel(), ListChannel()
        worker.submit(parsed("holder", stream=True, max_tokens=60_000, budget=512, ignore_eos=True), holder)
        while not holder.responses:
            time.sleep(0.01)
        sampling = SamplingParams(max_tokens=600, ignore_eos=True)  # 620 slots asked; 512 left beside the holder
        request = GenerationRequest("squeezed", list(range(5, 25)), sampling, CacheConfig("streaming", budget=1000))
        worker.submit(ParsedRequest(request, stream=False), squeezed)
        assert squeezed.done.wait(60)
        holder.cancelled = True
        assert holder.done.wait(10)
    finally:
        worker.stop()
    result = metrics.results["squeezed"]
    assert (result.degraded_from, result.budget, metrics.degraded) == (1000, 512, 1)
    assert squeezed.responses[-1]["kv_budget"][0, 0] == 512
    assert counts == {"resolve_budget": 2, "build_policy": 2}  # once per request


class ManagerVisits:
    """Which cache manager calls read one request's cache configuration: every CacheManager method is wrapped
    (the real one still runs), and the configuration notes a read of any of its fields while one runs."""

    def __init__(self, monkeypatch) -> None:
        self.visits: list[str] = []  # the outermost manager calls that read the configuration, in order
        self._local = threading.local()  # per thread: [method name, whether it read the configuration]
        for name, member in list(vars(CacheManager).items()):
            if inspect.isfunction(member) and not name.startswith("__"):
                monkeypatch.setattr(CacheManager, name, self._watched(name, member))

    def _watched(self, name: str, method):
        def watched(manager, *args, **kwargs):
            if getattr(self._local, "call", None) is not None:
                return method(manager, *args, **kwargs)
            self._local.call = call = [name, False]
            try:
                return method(manager, *args, **kwargs)
            finally:
                self._local.call = None
                if call[1]:
                    self.visits.append(name)
        return watched

    def config(self, *args, **kwargs) -> CacheConfig:
        visits = self

        class WatchedConfig(CacheConfig):
            def __getattribute__(self, name):
                call = getattr(visits._local, "call", None)
                if call is not None:
                    call[1] = True
                return super().__getattribute__(name)

        return WatchedConfig(*args, **kwargs)


def test_a_request_reaches_the_cache_manager_once(tiny_onnx_model_dir, monkeypatch):
    """From `EngineWorker.submit` through admission, a warm prefix's reuse, its first token and its end, the
    cache manager reads the request's cache configuration in one call: the plan admission, the reservation,
    the allocation and the result then share."""
    from transformers import AutoTokenizer

    watch = ManagerVisits(monkeypatch)
    decoder = DecoderStep(tiny_onnx_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_onnx_model_dir / "tokenizer")

    def engine() -> Engine:
        made = Engine(decoder, EngineConfig(prefill_chunk=8, min_kv_budget=8), tokenizer=tokenizer)
        assert made.warm_prefix(list(range(5, 21)), CacheConfig("streaming", budget=16)) == 16
        return made

    metrics = FinishedResults()
    worker = EngineWorker(engine, tokenizer, metrics, idle_wait=0.01).start()
    try:
        channel = ListChannel()
        request = GenerationRequest("walked", list(range(5, 30)), SamplingParams(max_tokens=6, ignore_eos=True),
                                    watch.config("streaming", budget=16))
        worker.submit(ParsedRequest(request, stream=True), channel)
        assert channel.done.wait(30) and len(channel.ids()) == 6 and not channel.errors
    finally:
        worker.stop()
    assert metrics.results["walked"].prefix_tokens_reused == 16
    assert watch.visits == ["plan"]


def test_an_engine_failure_fails_the_running_and_moves_the_waiting_to_a_new_engine(tiny_onnx_model_dir, monkeypatch):
    """A decoder call that raises once fails the engine's step: the request it was running gets an INTERNAL
    error, the two waiting for a place in the batch move to a new engine and complete there, and the KV pool's
    ledger (shared by both engines) ends with nothing reserved."""
    from transformers import AutoTokenizer

    decoder = DecoderStep(tiny_onnx_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_onnx_model_dir / "tokenizer")
    spec = ModelSpec.load(tiny_onnx_model_dir)
    pool = KVReservations(4096 * spec.kv_bytes_per_token, spec)
    engines: list[Engine] = []

    def engine() -> Engine:
        engines.append(Engine(decoder, EngineConfig(max_batch_size=1), tokenizer=tokenizer, reservations=pool))
        return engines[-1]

    fault = threading.Event()
    real_run = decoder.run

    def run(*args, **kwargs):
        if fault.is_set():
            fault.clear()
            raise RuntimeError("device lost")
        return real_run(*args, **kwargs)

    monkeypatch.setattr(decoder, "run", run)
    worker = EngineWorker(engine, tokenizer, idle_wait=0.01).start()
    try:
        running, waiting = ListChannel(), [ListChannel(), ListChannel()]
        worker.submit(parsed("running", stream=True, max_tokens=60_000, budget=64, ignore_eos=True), running)
        while not running.responses:
            time.sleep(0.01)
        for index, channel in enumerate(waiting):
            worker.submit(parsed(f"waiting{index}", stream=False, max_tokens=8, budget=64, ignore_eos=True), channel)
        assert engines[0].state().waiting == ("waiting0", "waiting1") and pool.reserved_bytes > 0
        fault.set()
        assert running.done.wait(30) and all(channel.done.wait(60) for channel in waiting)
    finally:
        worker.stop()
    assert running.errors == [("engine step failed: RuntimeError: device lost", ErrorKind.INTERNAL)]
    assert all(not channel.errors and len(channel.ids()) == 8 for channel in waiting)
    assert len(engines) == 2 and worker.engine is engines[1] and not engines[1].has_unfinished()
    assert pool.reserved_bytes == 0
