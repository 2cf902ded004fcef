"""`KVpopClient`: one object for HTTP and gRPC, built on the official tritonclient packages.

Complete answers go to `kvpop_service` (HTTP /infer works with it); token streams go to the decoupled
`kvpop_engine`, over gRPC bidirectional streaming or HTTP server-sent events (`generate_stream`).

Sessions: every call takes `session_id=`; `client.session()` opens a `Session` that sends its own
random id with every turn and closes it on the server when it is closed (or its `with` block ends).
"""

from __future__ import annotations

import json
import queue
import secrets
import urllib.error
import urllib.request
import uuid
from typing import Any, Iterator, Sequence

import numpy as np

from kvpop_client.contract import LIST_INPUTS, NUMPY_DTYPES, OPTION_INPUTS, PROMPT_INPUTS
from kvpop_client.errors import KVpopServerError, ResponseValidationError, status_from_message
from kvpop_client.types import Generation, StreamChunk, assemble_stream

SERVICE_MODEL = "kvpop_service"
ENGINE_MODEL = "kvpop_engine"
DEFAULT_URLS = {"http": "localhost:8000", "grpc": "localhost:8001"}
STATISTICS = ("finish_reason", "num_input_tokens", "num_output_tokens", "kv_budget", "peak_kv_bytes",
              "tokens_evicted", "compression")
SESSION_STATISTICS = ("tokens_reused", "tokens_computed")  # absent from servers before sessions

# Optional request inputs: name -> (Triton datatype, numpy dtype).
OPTIONAL_INPUTS: dict[str, tuple[str, Any]] = {
    name: (datatype, NUMPY_DTYPES[datatype]) for name, datatype in OPTION_INPUTS.items()
}


class KVpopClient:
    """Send generation requests over "http" or "grpc".

    Every input gets Triton's leading batch dimension of 1 (the models batch dynamically).
    """

    def __init__(self, url: str | None = None, protocol: str = "http", timeout: float = 300.0,
                 service_model: str = SERVICE_MODEL, engine_model: str = ENGINE_MODEL):
        if protocol not in DEFAULT_URLS:
            raise ValueError(f"protocol must be 'http' or 'grpc', got {protocol!r}")
        self.protocol, self.timeout = protocol, timeout
        self.service_model, self.engine_model = service_model, engine_model
        self.url = url or DEFAULT_URLS[protocol]
        if protocol == "http":
            import tritonclient.http as triton

            self._client = triton.InferenceServerClient(self.url, network_timeout=timeout, connection_timeout=timeout)
        else:
            import tritonclient.grpc as triton

            self._client = triton.InferenceServerClient(self.url)
        self._triton = triton

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> "KVpopClient":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # Health and metrics ------------------------------------------------------------------------
    def is_ready(self) -> bool:
        try:
            return bool(self._client.is_server_ready() and self._client.is_model_ready(self.service_model)
                        and self._client.is_model_ready(self.engine_model))
        except Exception:
            return False

    @staticmethod
    def metrics(metrics_url: str = "http://localhost:8002/metrics") -> dict[str, float]:
        """Prometheus samples from the metrics port: {'name{labels}': value}."""
        with urllib.request.urlopen(metrics_url, timeout=10) as response:
            text = response.read().decode()
        samples = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                samples[name] = float(value)
        return samples

    # Generation --------------------------------------------------------------------------------
    def build_inputs(self, prompt: str | Sequence[int] | Sequence[dict], stop: Sequence[str] = (), **options: Any) -> list:
        """`prompt`: text, token ids, or a chat (a list of {"role", "content"} dicts, sent as `messages`)."""
        triton = self._triton
        if _is_chat(prompt):
            data = np.array([[json.dumps(list(prompt)).encode("utf-8")]], dtype=np.object_)
            inputs = [triton.InferInput("messages", list(data.shape), PROMPT_INPUTS["messages"])]
        elif isinstance(prompt, str):
            data = np.array([[prompt.encode("utf-8")]], dtype=np.object_)
            inputs = [triton.InferInput("text_input", list(data.shape), PROMPT_INPUTS["text_input"])]
        else:
            data = np.asarray(prompt, dtype=np.int64).reshape(1, -1)
            if data.size and (data.min() < 0 or data.max() > np.iinfo(np.int32).max):
                raise ValueError("token ids must be in [0, 2**31)")
            data = data.astype(np.int32)  # the wire type, as in the TensorRT-LLM backend
            inputs = [triton.InferInput("input_ids", list(data.shape), PROMPT_INPUTS["input_ids"])]
        inputs[0].set_data_from_numpy(data)
        if stop:
            stop_data = np.array([[item.encode("utf-8") for item in stop]], dtype=np.object_)
            inputs.append(triton.InferInput("stop", list(stop_data.shape), LIST_INPUTS["stop"]))
            inputs[-1].set_data_from_numpy(stop_data)
        for name, value in options.items():
            if value is None:
                continue
            if name not in OPTIONAL_INPUTS:
                raise TypeError(f"unknown option {name!r}; known: {sorted(OPTIONAL_INPUTS)}")
            datatype, dtype = OPTIONAL_INPUTS[name]
            array = np.array([[value.encode() if isinstance(value, str) else value]], dtype=dtype)
            inputs.append(triton.InferInput(name, [1, 1], datatype))
            inputs[-1].set_data_from_numpy(array)
        return inputs

    def generate(self, prompt: str | Sequence[int], max_tokens: int | None = None, stop: Sequence[str] = (),
                 **options: Any) -> Generation:
        """One complete answer. `options`: temperature, top_p, top_k, seed, ignore_eos, eviction_policy,
        kv_budget, compression_ratio."""
        inputs = self.build_inputs(prompt, stop=stop, max_tokens=max_tokens, **options)
        try:
            if self.protocol == "http":
                result = self._client.infer(self.service_model, inputs, timeout=int(self.timeout * 1e6))
            else:
                result = self._client.infer(self.service_model, inputs, client_timeout=self.timeout)
        except self._triton.InferenceServerException as error:
            raise KVpopServerError(error.message(), error.status()) from None
        return Generation.from_outputs(lambda name: _first(result.as_numpy(name)), max_tokens)

    def chat(self, messages: Sequence[dict], max_tokens: int | None = None, stop: Sequence[str] = (),
             **options: Any) -> Generation:
        """The assistant's next turn after `messages` ([{"role": "user", "content": ...}, ...]), rendered
        by the model's chat template on the server; the model's end-of-turn token ends it."""
        return self.generate(_checked_chat(messages), max_tokens, stop, **options)

    def stream_chat(self, messages: Sequence[dict], max_tokens: int | None = None, stop: Sequence[str] = (),
                    **options: Any) -> Iterator[StreamChunk]:
        """`chat`, streamed: yields the answer's text as it is generated (see `stream`)."""
        return self.stream(_checked_chat(messages), max_tokens, stop, **options)

    # Sessions ----------------------------------------------------------------------------------
    def session(self, session_id: str | None = None, **options: Any) -> "Session":
        """A conversation whose cache the server keeps between turns: each call sends `session_id`
        (default: a new random one) and `options` (e.g. eviction_policy, kv_budget: reuse needs the
        same ones every turn); closing it frees the server's state."""
        return Session(self, session_id or new_session_id(), options)

    def close_session(self, session_id: str) -> None:
        """Forget a session's saved state on the server (memory and checkpoint). The service has no
        request that only closes, so this is a one-token turn with `session_close` (its answer is
        dropped); closing an unknown or already closed id is harmless."""
        self.generate([0], max_tokens=1, session_id=session_id, session_close=True)

    def stream(self, prompt: str | Sequence[int], max_tokens: int | None = None, stop: Sequence[str] = (),
               **options: Any) -> Iterator[StreamChunk]:
        """Yield text and tokens as they are generated; the last chunk carries the validated result.

        Closing the iterator early cancels the request on the server (its KV slots are freed).
        """
        if self.protocol == "grpc":
            yield from self._stream_grpc(prompt, max_tokens, stop, options)
        else:
            yield from self._stream_sse(prompt, max_tokens, stop, options)

    def _stream_grpc(self, prompt, max_tokens, stop, options) -> Iterator[StreamChunk]:
        # A tritonclient gRPC client carries one stream at a time: each stream gets its own channel,
        # so one KVpopClient can stream from many threads at once.
        responses: queue.Queue = queue.Queue()
        inputs = self.build_inputs(prompt, stop=stop, max_tokens=max_tokens, stream=True, **options)
        client = self._triton.InferenceServerClient(self.url)
        client.start_stream(callback=lambda result, error: responses.put((result, error)), stream_timeout=self.timeout)
        finished = False
        try:
            client.async_stream_infer(self.engine_model, inputs, request_id=uuid.uuid4().hex,
                                      enable_empty_final_response=True)
            chunks: list[StreamChunk] = []
            while True:
                result, error = responses.get(timeout=self.timeout)
                if error is not None:  # in-stream errors carry no gRPC status: the message's tag names it
                    raise KVpopServerError(error.message(), error.status() or status_from_message(error.message()))
                response = result.get_response()
                is_final = response.parameters["triton_final_response"].bool_param
                if not response.outputs:  # the empty final response that closes the stream
                    if is_final:
                        break
                    continue
                values = {name: _first(result.as_numpy(name)) for name in ("text_output", "output_ids", *STATISTICS, *SESSION_STATISTICS)}
                chunk = _chunk(values, chunks, max_tokens)
                chunks.append(chunk)
                yield chunk
                if chunk.result is not None:
                    finished = True
                if is_final:
                    break
        finally:
            client.stop_stream(cancel_requests=not finished)  # an abandoned stream is cancelled on the server
            client.close()

    def _stream_sse(self, prompt, max_tokens, stop, options) -> Iterator[StreamChunk]:
        if not isinstance(prompt, str) and not _is_chat(prompt):
            raise TypeError("HTTP streaming (generate_stream) takes a text prompt or a chat; use protocol='grpc' for token ids")
        first = {"messages": json.dumps(list(prompt))} if _is_chat(prompt) else {"text_input": prompt}
        body = {**first, "stream": True, **{k: v for k, v in options.items() if v is not None}}
        if max_tokens is not None:
            body["max_tokens"] = max_tokens
        if stop:
            body["stop"] = list(stop)
        url = f"http://{self.url}/v2/models/{self.engine_model}/generate_stream"
        request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        try:
            response = urllib.request.urlopen(request, timeout=self.timeout)
        except urllib.error.HTTPError as error:
            message = _error_message(error.read())
            # Triton 2.51 answers any error before the first event with 400: the message's tag knows better.
            raise KVpopServerError(message, status_from_message(message, str(error.code))) from None
        chunks: list[StreamChunk] = []
        with response:  # closing the connection early cancels the request
            for raw in response:
                line = raw.decode("utf-8").strip()
                if not line.startswith("data:"):
                    continue
                event = json.loads(line[len("data:"):])
                if "error" in event:
                    raise KVpopServerError(event["error"], status_from_message(event["error"]))
                ids = event.get("output_ids", [])
                event["output_ids"] = np.array(ids if isinstance(ids, list) else [ids], dtype=np.int64)
                event["text_output"] = np.array([event.get("text_output", "").encode()], dtype=np.object_)
                chunk = _chunk(event, chunks, max_tokens)
                chunks.append(chunk)
                yield chunk
                if chunk.result is not None:
                    return
        raise KVpopServerError("the stream ended before its final answer (the server went away)", "UNAVAILABLE")


class Session:
    """One conversation kept on the server: the `KVpopClient` calls with this session's id and options.

    Send the whole history every turn as usual; the server then computes only what is new (each
    result's `tokens_reused` / `tokens_computed` say how much). Use it as a context manager, or call
    `close` (idempotent) when the conversation ends."""

    def __init__(self, client: KVpopClient, session_id: str, options: dict[str, Any]) -> None:
        self.client, self.id, self.options = client, session_id, options
        self.closed = False

    def _options(self, options: dict[str, Any]) -> dict[str, Any]:
        if self.closed:
            raise RuntimeError(f"session {self.id} is closed")
        return {**self.options, **options, "session_id": self.id}

    def generate(self, prompt: str | Sequence[int], max_tokens: int | None = None, stop: Sequence[str] = (), **options: Any) -> Generation:
        return self.client.generate(prompt, max_tokens, stop, **self._options(options))

    def stream(self, prompt: str | Sequence[int], max_tokens: int | None = None, stop: Sequence[str] = (), **options: Any) -> Iterator[StreamChunk]:
        return self.client.stream(prompt, max_tokens, stop, **self._options(options))

    def chat(self, messages: Sequence[dict], max_tokens: int | None = None, stop: Sequence[str] = (), **options: Any) -> Generation:
        return self.client.chat(messages, max_tokens, stop, **self._options(options))

    def stream_chat(self, messages: Sequence[dict], max_tokens: int | None = None, stop: Sequence[str] = (), **options: Any) -> Iterator[StreamChunk]:
        return self.client.stream_chat(messages, max_tokens, stop, **self._options(options))

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.client.close_session(self.id)

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def new_session_id() -> str:
    """An opaque random id (32 url-safe characters: within the server's allowed set and length)."""
    return secrets.token_urlsafe(24)


def _chunk(values: dict, previous: list[StreamChunk], max_tokens: int | None) -> StreamChunk:
    """Validate one streamed response and, when it is the last, assemble the whole result."""
    raw_text = np.asarray(values["text_output"]).reshape(-1)
    if raw_text.size != 1:
        raise ResponseValidationError(f"text_output should hold one string, got {raw_text.size}")
    text = raw_text[0].decode("utf-8") if isinstance(raw_text[0], bytes) else str(raw_text[0])
    ids = np.asarray(values["output_ids"]).reshape(-1)
    if not np.issubdtype(ids.dtype, np.integer):
        raise ResponseValidationError(f"output_ids should be integers, got {ids.dtype}")
    reason = np.asarray(values["finish_reason"]).reshape(-1)[0]
    reason = (reason.decode() if isinstance(reason, bytes) else str(reason)) or None
    chunk = StreamChunk(text, [int(token) for token in ids], reason)
    if reason is None:
        return chunk
    final = {name: np.asarray(values[name]).reshape(-1)[0] for name in STATISTICS}
    final.update({name: np.asarray(values[name]).reshape(-1)[0] for name in SESSION_STATISTICS if values.get(name) is not None})
    final["finish_reason"] = reason
    result = assemble_stream([*previous, chunk], final, max_tokens)
    return StreamChunk(chunk.text, chunk.token_ids, reason, result)


def _is_chat(prompt: Any) -> bool:
    return isinstance(prompt, (list, tuple)) and bool(prompt) and all(isinstance(item, dict) for item in prompt)


def _checked_chat(messages: Sequence[dict]) -> list[dict]:
    if not _is_chat(messages) or not all(isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in messages):
        raise TypeError('messages must be a non-empty list of {"role": str, "content": str} dicts')
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def _first(array: np.ndarray | None) -> np.ndarray | None:
    """Drop the batch dimension of 1."""
    return None if array is None else array[0]


def _error_message(body: bytes) -> str:
    try:
        return json.loads(body).get("error", body.decode(errors="replace"))
    except ValueError:
        return body.decode(errors="replace")
