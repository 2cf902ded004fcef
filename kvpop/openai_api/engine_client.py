"""One generation on `kvpop_engine` over Triton's gRPC streaming API (kvpop.serving.engine_stream), as an async
iterator of deltas."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import AsyncIterator

import numpy as np

from kvpop.serving import contract
from kvpop.serving.engine_stream import StreamError, engine_inputs, stream_generate
from kvpop.serving.errors import kind_of

# The cache statistics of the engine's final response (the contract's outputs sent with the last response only)
# that an OpenAI answer reports; `tokens_computed` is its usage's prompt tokens less `tokens_reused`.
CACHE_STATISTICS = tuple(spec.name for spec in contract.OUTPUTS if not spec.streamed and spec.name != "tokens_computed")
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
        """The engine's input tensors (typed by the contract), each with Triton's leading batch dimension of 1."""
        values = {"stream": True, **({"ignore_eos": True} if self.ignore_eos else {})}
        if self.messages is not None:
            values["messages"] = json.dumps(self.messages)
        else:
            values["text_input"] = self.prompt or ""
        for name in ("max_tokens", "temperature", "top_p", "seed", "kv_budget", "compression_ratio", "eviction_policy",
                     "session_id"):
            if getattr(self, name) is not None:
                values[name] = getattr(self, name)
        if self.stop:
            values["stop"] = list(self.stop)
        return engine_inputs(values)

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
        responses = stream_generate(self._client, request.tensors(), request.parameters(), OUTPUTS, self.model_name)
        try:
            async for result in responses:
                yield _delta(result)
        except StreamError as error:
            raise EngineError(str(error)) from None
        except Exception as error:  # unreachable server, broken stream
            if isinstance(error, GeneratorExit):
                raise
            raise EngineError(f"the engine is unavailable: {error}", kind="overloaded") from error
        finally:
            await responses.aclose()  # a reader that stopped early: the stream is cancelled


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
