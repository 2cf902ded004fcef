"""The smallest HTTP server a user would put in front of ONNX Runtime GenAI's `Engine` (the library ships
none), for comparison only. Runs in the peer's own environment (`make ortgenai-peer`), never in .venv:

    build/ortgenai/venv/bin/python -m kvpop_eval.bench.ortgenai_server --model build/ortgenai/fp32 --port 8200

GET /health -> 200 once the model is loaded. POST /generate {"input_ids": [...], "max_tokens": n} -> one JSON
line per token as the engine makes it ({"token": id}), then {"finish_reason": ...} or {"error": ...}; greedy,
exactly n tokens (the minimum is the maximum, so EOS never ends a request early); a bad body -> 400.

One thread drives the engine; every request joins it through a queue. On CPU the 0.18 Engine batches
statically: the requests waiting when a batch starts (up to --max-batch) run together to the last token of
the longest, and a request arriving meanwhile waits until that whole batch is done (its continuous batching
needs paged attention, which the model builder makes for CUDA and WebGPU only). So an idle server, as a
simple batcher does, waits --max-wait-ms after a first request for others to join its batch. It keeps no
prefix cache.
"""

from __future__ import annotations

import argparse
import json
import queue
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import onnxruntime_genai as og

EVENTS_PER_RUN = 256  # the engine's event buffer: one step's events of a whole batch


class EngineLoop:
    """The engine, owned by one thread (the library allows no other): requests queue here, their tokens
    come back on their own queues."""

    def __init__(self, model_dir: Path, max_batch: int, max_wait_s: float, max_length: int | None, threads: int) -> None:
        self.max_batch, self.max_wait_s = max_batch, max_wait_s
        model = json.loads((model_dir / "genai_config.json").read_text())["model"]
        self.vocab_size = int(model["vocab_size"])
        self.max_length = min(max_length or model["context_length"], model["context_length"])
        self.config = og.Config(str(model_dir))  # the batch's KV buffers hold max_length tokens per request
        self.config.overlay(json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": threads}}},
                                        "search": {"max_length": self.max_length},
                                        "engine": {"static_batching": {"max_batch_size": max_batch}}}))
        self.ready = threading.Event()
        self.failed: str | None = None
        self._arrivals: queue.Queue = queue.Queue()
        self._streams: dict[int, tuple[og.Request, queue.Queue]] = {}  # id(request) -> (request, its messages)
        threading.Thread(target=self._run, name="engine", daemon=True).start()

    def submit(self, input_ids: list[int], max_tokens: int) -> queue.Queue:
        messages: queue.Queue = queue.Queue()
        self._arrivals.put((input_ids, max_tokens, messages))
        return messages

    def _admit(self, input_ids: list[int], max_tokens: int, messages: queue.Queue) -> None:
        request = self.engine.create_request()
        options = og.TurnOptions(request)
        options.set_do_sample(False)
        options.set_max_generated_tokens(max_tokens)
        options.set_min_generated_tokens(max_tokens)
        try:
            request.begin_turn(np.asarray(input_ids, dtype=np.int32), options)
        except Exception as error:  # this request's failure only
            messages.put({"error": f"{type(error).__name__}: {error}"})
            request.close()
            return
        self._streams[id(request)] = (request, messages)

    def _gather_batch(self) -> None:
        """Wait for a first request, then up to max_wait_s for others to start the batch with it."""
        self._admit(*self._arrivals.get())
        deadline = time.monotonic() + self.max_wait_s
        for _ in range(self.max_batch - 1):
            try:
                self._admit(*self._arrivals.get(timeout=max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                return

    def _run(self) -> None:
        try:
            self.engine = og.Engine(og.Model(self.config))
            buffer = self.engine.create_event_buffer(EVENTS_PER_RUN)
            self.ready.set()
            while True:
                if not self.engine.has_pending_requests():
                    self._gather_batch()
                while not self._arrivals.empty():
                    self._admit(*self._arrivals.get_nowait())
                for event in self.engine.run(buffer):
                    self._deliver(event)
        except Exception as error:  # the static engine is unusable after a failed step: say so to everyone
            self.failed = f"{type(error).__name__}: {error}"
            self.ready.set()
            for _, messages in self._streams.values():
                messages.put({"error": self.failed})

    def _deliver(self, event) -> None:
        request, messages = self._streams[id(event.request)]
        if event.flags & og.EngineEventFlags.TOKEN:
            messages.put({"token": int(event.token)})
        if event.flags & og.EngineEventFlags.FAILED:
            messages.put({"error": f"engine error {event.error_code}"})
        elif event.flags & og.EngineEventFlags.TURN_FINISHED:
            messages.put({"finish_reason": event.finish_reason.name})
        else:
            return
        del self._streams[id(event.request)]
        request.close()


def bad_request(body: object, loop: EngineLoop) -> str | None:
    """Why `body` is not a request this server can run, or None."""
    if not isinstance(body, dict):
        return "the body must be a JSON object"
    input_ids, max_tokens = body.get("input_ids"), body.get("max_tokens")
    if not isinstance(input_ids, list) or not input_ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in input_ids):
        return "input_ids must be a non-empty list of token ids"
    if not all(0 <= t < loop.vocab_size for t in input_ids):
        return f"token ids must lie in [0, {loop.vocab_size})"
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        return "max_tokens must be a positive integer"
    if len(input_ids) + max_tokens > loop.max_length:
        return f"prompt + max_tokens exceeds the server's {loop.max_length} positions per request"
    return None


def handler_for(loop: EngineLoop) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            healthy = self.path == "/health" and loop.ready.is_set() and loop.failed is None
            self._answer(200 if healthy else 404 if self.path != "/health" else 503, {"ok": healthy})

        def do_POST(self) -> None:
            if self.path != "/generate":
                return self._answer(404, {"error": f"no {self.path}"})
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"null")
            except ValueError as error:  # not JSON, not UTF-8, or no length
                return self._answer(400, {"error": f"the body is not JSON: {error}"})
            problem = bad_request(body, loop)
            if problem is not None:
                return self._answer(400, {"error": problem})
            if loop.failed is not None:
                return self._answer(503, {"error": loop.failed})
            messages = loop.submit(body["input_ids"], body["max_tokens"])
            self.send_response(200)
            self.send_header("Content-Type", "application/x-ndjson")
            self.end_headers()
            try:
                while True:
                    message = messages.get()
                    self.wfile.write(json.dumps(message).encode() + b"\n")
                    self.wfile.flush()
                    if "token" not in message:
                        return
            except (BrokenPipeError, ConnectionResetError):  # the client left; its request runs out with its batch
                return

        def _answer(self, status: int, message: dict) -> None:
            payload = json.dumps(message).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, format: str, *args) -> None:  # one line per request is noise in a benchmark's log
            return

    return Handler


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m kvpop_eval.bench.ortgenai_server", description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help="a model directory the ONNX Runtime GenAI builder wrote")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--max-batch", type=int, default=8, help="requests one static batch holds")
    parser.add_argument("--max-wait-ms", type=float, default=10.0, help="how long an idle server waits for a batch to fill")
    parser.add_argument("--max-length", type=int, default=None, help="prompt + output tokens per request (default: the model's)")
    parser.add_argument("--threads", type=int, default=2, help="onnxruntime intra-op threads")
    args = parser.parse_args(argv)
    loop = EngineLoop(args.model, args.max_batch, args.max_wait_ms / 1e3, args.max_length, args.threads)
    loop.ready.wait()
    if loop.failed is not None:
        raise SystemExit(f"the engine did not start: {loop.failed}")
    ThreadingHTTPServer(("127.0.0.1", args.port), handler_for(loop)).serve_forever()


if __name__ == "__main__":
    main()
