"""The front end's path to the engine: one gRPC stream per prompt to the server's own endpoint.

Why not BLS: in the Triton 2.51 Python backend stub a decoupled BLS call's responses (whose tensors
hold Python objects) are released by the stub's IPC thread without the GIL whenever that thread
drops the last reference, which corrupted kvpop_service's heap under sustained load (see
docs/RELIABILITY.md). A BLS call can also not be cancelled in 2.51, and the parent runs BLS calls
on a bounded thread pool, which hid a queue inside the front end. A loopback gRPC stream has none
of these problems: the engine sees a normal request (its own queue and back-pressure apply), a
client that goes away cancels the stream and the engine frees the slots at its next step, and
errors keep their kind (kvpop.serving.errors). All calls run on one asyncio loop in one thread.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from kvpop.serving.contract import ErrorKind
from kvpop.serving.engine_stream import StreamError, is_final, stream_generate
from kvpop.serving.errors import kind_of, tagged

PAD_TOKEN_ID = -1  # pads output_ids when the prompts of one batched request get answers of unequal length


@dataclass
class ForwardError(Exception):
    kind: ErrorKind
    message: str

    def __str__(self) -> str:
        return self.message


@dataclass
class ForwardJob:
    """One client request: one engine request per prompt of its batch."""

    prompts: list[dict[str, np.ndarray]]  # per prompt: input name -> array with a batch dimension of 1
    parameters: dict  # request parameters (plain JSON scalars) forwarded to every prompt
    on_done: Callable[["ForwardJob", dict[str, np.ndarray] | None, ForwardError | None], None]
    context: object = None  # the caller's, e.g. the Triton request and its response sender
    job_id: int = field(default=0)


def merge_answers(answers: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Stack per-prompt answers (each with batch dimension 1) into one batch, padding output_ids."""
    merged = {}
    for name in answers[0]:
        arrays = [answer[name] for answer in answers]
        if name == "output_ids":
            width = max(array.shape[1] for array in arrays)
            arrays = [np.pad(array, ((0, 0), (0, width - array.shape[1])), constant_values=PAD_TOKEN_ID)
                      for array in arrays]
        merged[name] = np.concatenate(arrays, axis=0)
    return merged


class EngineForwarder:
    """Sends each prompt of a job to the engine over gRPC and calls `job.on_done` once per job.

    `on_done` runs on the forwarder's loop thread; it must not block for long.
    """

    def __init__(self, url: str, engine_model: str, max_in_flight: int, output_names: list[str]) -> None:
        self.url, self.engine_model, self.max_in_flight = url, engine_model, max_in_flight
        self.output_names = list(output_names)  # the front end's outputs, which the engine also has
        self._loop = asyncio.new_event_loop()
        self._ids = itertools.count(1)
        self._tasks: dict[int, asyncio.Task] = {}  # loop thread only
        self._failures: dict[int, ForwardError] = {}  # loop thread only: why a task was cancelled
        self._in_flight = 0
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvpop-forwarder", daemon=True)
        self._thread.start()
        self._client = asyncio.run_coroutine_threadsafe(self._connect(), self._loop).result(30)

    async def _connect(self):
        import tritonclient.grpc.aio as grpc_aio

        return grpc_aio.InferenceServerClient(self.url)

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def submit(self, job: ForwardJob) -> int:
        """Start a job; raises ForwardError(OVERLOADED) at once when max_in_flight jobs are running."""
        with self._lock:
            if self._in_flight >= self.max_in_flight:
                raise ForwardError(ErrorKind.OVERLOADED, tagged(
                    ErrorKind.OVERLOADED, f"overloaded: {self._in_flight} requests in flight in the front end; retry later"))
            self._in_flight += 1
        job.job_id = next(self._ids)
        self._loop.call_soon_threadsafe(self._start, job)
        return job.job_id

    def cancel(self, job_id: int) -> None:
        """Cancel a job's engine streams (the client went away): the engine frees its slots."""
        self._loop.call_soon_threadsafe(self._cancel, job_id)

    def fail_all(self, error: ForwardError) -> None:
        """Fail every running job with `error` now (the engine is going away: clients should retry)."""
        self._loop.call_soon_threadsafe(self._fail_all, error)

    def close(self) -> None:
        async def shutdown():
            for task in list(self._tasks.values()):
                task.cancel()
            await self._client.close()

        try:
            asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(10)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)

    # -- the loop thread ---------------------------------------------------------------------------
    def _start(self, job: ForwardJob) -> None:
        task = self._loop.create_task(self._run(job))
        self._tasks[job.job_id] = task

    def _cancel(self, job_id: int) -> None:
        task = self._tasks.get(job_id)
        if task is not None:
            task.cancel()

    def _fail_all(self, error: ForwardError) -> None:
        for job_id, task in list(self._tasks.items()):
            self._failures[job_id] = error
            task.cancel()

    async def _run(self, job: ForwardJob) -> None:
        answer, error = None, None
        try:
            answers = await asyncio.gather(*(self._generate(prompt, job.parameters) for prompt in job.prompts))
            answer = merge_answers(answers)
        except ForwardError as forward_error:
            error = forward_error
        except asyncio.CancelledError:
            error = self._failures.pop(job.job_id, None) or ForwardError(ErrorKind.INTERNAL, "cancelled: the client went away")
        except Exception as unexpected:  # the engine unreachable, a broken stream: fail this request only
            error = ForwardError(ErrorKind.OVERLOADED, tagged(ErrorKind.OVERLOADED, f"the engine is unavailable: {unexpected}"))
        finally:
            self._tasks.pop(job.job_id, None)
            with self._lock:
                self._in_flight -= 1
        try:
            job.on_done(job, answer, error)
        except Exception as callback_error:  # a bug answering one request must not go unnoticed
            print(f"[kvpop_service] answering request {job.job_id} failed: {callback_error!r}", flush=True)

    async def _generate(self, inputs: dict[str, np.ndarray], parameters: dict) -> dict[str, np.ndarray]:
        """The engine's one final answer to one prompt (the request is not streamed: no token responses)."""
        final = None
        try:
            async for result in stream_generate(self._client, inputs, parameters, self.output_names, self.engine_model):
                final = {name: result.as_numpy(name) for name in self.output_names} if is_final(result) else None
        except StreamError as error:
            raise ForwardError(kind_of(str(error)), str(error)) from None
        if final is None:
            raise ForwardError(ErrorKind.INTERNAL, tagged(ErrorKind.INTERNAL, f"{self.engine_model} sent no answer"))
        return final
