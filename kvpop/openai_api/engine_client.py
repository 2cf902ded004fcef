"""One generation on `kvpop_engine` over Triton's gRPC streaming API, as an async iterator of deltas."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import AsyncIterator

import numpy as np

from kvpop.serving.errors import kind_of

# The engine's final response carries these cache statistics (model_repository/kvpop_engine/config.pbtxt).
CACHE_STATISTICS = ("kv_budget", "peak_kv_bytes", "tokens_evicted", "compression", "tokens_reused")
OUTPUTS = ("text_output", "finish_reason", "num_input_tokens", "num_output_tokens", *CACHE_STATISTICS)


class EngineError(Exception):
    """The engine refused or failed the request; `kind` is kvpop.serving.errors' kind of the message."""

    def __init__(self, message: str, kind: str | None = None) -> None:
        super().__init__(message)
        self.kind = kind or kind_of(message)


@dataclass
class EngineRequest:
    """What one OpenAI request asks of the engine. Exactly one of `messages` and `prompt` is set."""

    messages: list[dict] | None = None  # a chat: the engine renders the model's chat template
    prompt: str | None = None  # a raw completion prompt (no chat template)
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    eviction_policy: str | None = None
    kv_budget: int | None = None
    compression_ratio: float | None = None
    session_id: str | None = None
    ignore_eos: bool = False

    def tensors(self) -> dict[str, np.ndarray]:
        """The engine's input tensors, each with Triton's leading batch dimension of 1."""
        def text(value: str) -> np.ndarray:
            return np.array([[value.encode("utf-8")]], dtype=np.object_)

        inputs = {"stream": np.array([[True]], dtype=np.bool_)}
        if self.ignore_eos:
            inputs["ignore_eos"] = np.array([[True]], dtype=np.bool_)
        if self.messages is not None:
            inputs["messages"] = text(json.dumps(self.messages))
        else:
            inputs["text_input"] = text(self.prompt or "")
        scalars = {
            "max_tokens": (self.max_tokens, np.int32), "temperature": (self.temperature, np.float32),
            "top_p": (self.top_p, np.float32), "seed": (self.seed, np.uint64),
            "kv_budget": (self.kv_budget, np.int32), "compression_ratio": (self.compression_ratio, np.float32),
        }
        for name, (value, dtype) in scalars.items():
            if value is not None:
                inputs[name] = np.array([[value]], dtype=dtype)
        for name in ("eviction_policy", "session_id"):
            value = getattr(self, name)
            if value is not None:
                inputs[name] = text(value)
        if self.stop:
            inputs["stop"] = np.array([[item.encode("utf-8") for item in self.stop]], dtype=np.object_)
        return inputs

    def parameters(self) -> dict:
        # A completion prompt is the model's input as written, never wrapped in the chat template.
        return {"raw_prompt": True} if self.messages is None else {}


@dataclass
class Delta:
    """One engine response: new text, and on the last one why it finished and what the cache held."""

    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str | None = None  # "stop" | "length" | "cancelled" on the last delta
    cache: dict[str, float] = field(default_factory=dict)


class EngineClient:
    """A gRPC connection to tritonserver, shared by every request of the API process."""

    def __init__(self, url: str, model_name: str = "kvpop_engine") -> None:
        self.url, self.model_name = url, model_name
        self._connection = None  # made on first use, inside the server's event loop (gRPC aio binds to it)

    @property
    def _client(self):
        if self._connection is None:
            import tritonclient.grpc.aio as grpc_aio

            self._connection = grpc_aio.InferenceServerClient(self.url)
        return self._connection

    async def is_ready(self) -> bool:
        try:
            return await self._client.is_model_ready(self.model_name)
        except Exception:  # the server is down or restarting
            return False

    async def close(self) -> None:
        if self._connection is not None:
            await self._connection.close()

    async def generate(self, request: EngineRequest) -> AsyncIterator[Delta]:
        """Yield the engine's deltas. Closing the iterator early (the HTTP client went away) cancels the
        Triton request, and the engine frees the sequence's slots at its next step."""
        import tritonclient.grpc as grpc_client
        from tritonclient.utils import np_to_triton_dtype

        tensors = []
        for name, array in request.tensors().items():
            tensor = grpc_client.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
            tensor.set_data_from_numpy(array)
            tensors.append(tensor)
        outputs = [grpc_client.InferRequestedOutput(name) for name in OUTPUTS]

        async def one_request():
            yield {"model_name": self.model_name, "inputs": tensors, "outputs": outputs,
                   "parameters": request.parameters() or None}

        responses = self._client.stream_infer(one_request())
        finished = False
        try:
            async for result, error in responses:
                if error is not None:
                    raise EngineError(str(error.message() if hasattr(error, "message") else error))
                delta = _delta(result)
                finished = delta.finish_reason is not None
                yield delta
                if finished:
                    return
        except EngineError:
            raise
        except Exception as error:  # unreachable server, broken stream
            if isinstance(error, GeneratorExit):
                raise
            raise EngineError(f"the engine is unavailable: {error}", kind="overloaded") from error
        finally:
            if not finished:
                responses.cancel()


def _delta(result) -> Delta:
    def scalar(name: str):
        array = result.as_numpy(name)
        return None if array is None else array.reshape(-1)[0]

    text = scalar("text_output")
    finish = scalar("finish_reason")
    finish_reason = finish.decode() if isinstance(finish, bytes) and finish else None
    cache = {}
    if finish_reason is not None:
        cache = {name: scalar(name).item() for name in CACHE_STATISTICS if scalar(name) is not None}
    return Delta(
        text=text.decode("utf-8") if isinstance(text, bytes) else str(text or ""),
        prompt_tokens=int(scalar("num_input_tokens") or 0),
        completion_tokens=int(scalar("num_output_tokens") or 0),
        finish_reason=finish_reason,
        cache=cache,
    )
