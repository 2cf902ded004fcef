"""OpenAI request bodies, validated, and their translation into an `EngineRequest`.

Fields the engine cannot honour are refused with a 400 that names them, never silently ignored: a
client that asks for tools, log-probabilities or several choices must learn that it did not get them.
Fields that change nothing about the answer (`user`, `metadata`, `store`, `service_tier`) are accepted.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from kvpop.openai_api.engine_client import EngineRequest
from kvpop.serving import contract


class RequestError(Exception):
    """A client mistake: answered 400 with OpenAI's `invalid_request_error` naming `param`."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def _wire(input_name: str) -> BeforeValidator:
    """A field sent as the engine input `input_name`: checked against that input's wire type first, so a
    boolean is not taken for a number and nothing wraps around (kvpop.serving.contract.TensorSpec.check)."""
    spec = contract.SCALAR_INPUTS[input_name]
    return BeforeValidator(lambda value: value if value is None else spec.check(value))


class StreamOptions(BaseModel):
    include_usage: bool = False


class KVpopOptions(BaseModel):
    """The bounded cache's controls, sent as extra body fields (`extra_body` in the openai SDK)."""

    eviction_policy: str | None = None  # full | streaming | h2o | tova | random | kvpop
    compression_ratio: Annotated[float | None, _wire("compression_ratio")] = None  # 1 - budget / tokens seen, in [0, 1)
    # slots per attention head; 0, as on every route, means not set (a bounded policy's default budget)
    kv_budget: Annotated[int | None, _wire("kv_budget")] = Field(default=None, ge=0)
    session_id: str | None = None  # keep this conversation's cache between turns
    ignore_eos: bool = False  # generate exactly max_tokens (benchmarks; vLLM's server takes it too)


class _Common(KVpopOptions):
    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: Annotated[int | None, _wire("max_tokens")] = Field(default=None, ge=1)
    temperature: Annotated[float | None, _wire("temperature")] = Field(default=None, ge=0.0, le=2.0)
    top_p: Annotated[float | None, _wire("top_p")] = Field(default=None, gt=0.0, le=1.0)
    seed: Annotated[int | None, _wire("seed")] = Field(default=None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    n: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    # Standard fields this server does not implement: refused when they ask for anything.
    _unsupported: tuple[str, ...] = ()
    # Accepted and without effect on the answer.
    _ignored = ("user", "metadata", "store", "service_tier", "parallel_tool_calls")

    def check(self) -> None:
        if self.n not in (None, 1):
            raise RequestError("n must be 1: this server returns one choice per request", "n")
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                raise RequestError(f"{name} is not supported (only 0)", name)
        if self.logit_bias:
            raise RequestError("logit_bias is not supported", "logit_bias")
        if self.stream_options is not None and not self.stream:
            raise RequestError("stream_options is only allowed with stream: true", "stream_options")
        extra = self.model_extra or {}
        for name, value in extra.items():
            if name in self._ignored:
                continue
            if name in self._unsupported and _neutral(name, value):
                continue
            if name in self._unsupported:
                raise RequestError(f"{name} is not supported by this server", name)
            raise RequestError(f"unknown field {name!r}", name)

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def engine_request(self, **prompt: Any) -> EngineRequest:
        self.check()
        return EngineRequest(
            max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p, seed=self.seed,
            stop=self.stop_strings(), eviction_policy=self.eviction_policy, kv_budget=self.kv_budget,
            compression_ratio=self.compression_ratio, session_id=self.session_id,
            ignore_eos=self.ignore_eos, **prompt,
        )


def _neutral(name: str, value: Any) -> bool:
    """Whether an unsupported field is sent at the value that asks for nothing (SDKs send some)."""
    if name == "best_of":
        return value in (None, 1)
    if name == "response_format":
        return value in (None, {"type": "text"})
    return value is None or value is False or value in ([], {}, "none", "auto")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None

    def text(self, index: int) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise RequestError(f"messages[{index}]: only text content parts are supported", f"messages[{index}].content")
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Annotated[int | None, _wire("max_tokens")] = Field(default=None, ge=1)
    _unsupported = ("tools", "tool_choice", "functions", "function_call", "response_format", "logprobs",
                    "top_logprobs", "modalities", "audio", "prediction", "reasoning_effort", "web_search_options")

    def to_engine(self) -> EngineRequest:
        messages = []
        for index, message in enumerate(self.messages):
            role = "system" if message.role == "developer" else message.role  # OpenAI's newer name for system
            messages.append({"role": role, "content": message.text(index)})
        request = self.engine_request(messages=messages)
        if self.max_completion_tokens is not None:
            request.max_tokens = self.max_completion_tokens
        return request


class CompletionRequest(_Common):
    prompt: str | list[str]
    _unsupported = ("logprobs", "echo", "suffix", "best_of")

    def to_engine(self) -> EngineRequest:
        prompt = self.prompt
        if isinstance(prompt, list):
            if len(prompt) != 1:
                raise RequestError("prompt must be one string (a list of one string is accepted)", "prompt")
            prompt = prompt[0]
        if not prompt.strip():
            raise RequestError("prompt is empty", "prompt")
        return self.engine_request(prompt=prompt)
