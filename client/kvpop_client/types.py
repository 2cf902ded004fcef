"""Typed, validated results: a response that breaks the API contract raises, never passes silently."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from kvpop_client.contract import FINISH_REASONS
from kvpop_client.errors import ResponseValidationError


@dataclass(frozen=True)
class Generation:
    text: str
    output_ids: list[int]
    finish_reason: str
    num_input_tokens: int
    num_output_tokens: int
    kv_budget: int
    peak_kv_bytes: int
    tokens_evicted: int
    compression: float
    tokens_reused: int = 0  # prompt tokens taken from the session's saved cache (servers before sessions: 0)
    tokens_computed: int = 0  # prompt tokens prefilled by this request

    @classmethod
    def from_outputs(cls, get: Callable[[str], np.ndarray | None], max_tokens: int | None = None) -> "Generation":
        def required(name: str) -> np.ndarray:
            value = get(name)
            if value is None:
                raise ResponseValidationError(f"response has no {name} output")
            return np.asarray(value)

        def scalar(name: str, kind: type):
            value = required(name)
            if value.size != 1:
                raise ResponseValidationError(f"{name} should hold one value, got shape {list(value.shape)}")
            return kind(value.reshape(-1)[0])

        text_array = required("text_output")
        if text_array.size != 1:
            raise ResponseValidationError(f"text_output should hold one string, got shape {list(text_array.shape)}")
        raw = text_array.reshape(-1)[0]
        try:
            text = raw.decode("utf-8") if isinstance(raw, (bytes, np.bytes_)) else str(raw)
        except UnicodeDecodeError as error:
            raise ResponseValidationError(f"text_output is not valid UTF-8: {error}") from None
        ids = required("output_ids")
        if not np.issubdtype(ids.dtype, np.integer):
            raise ResponseValidationError(f"output_ids should be integers, got {ids.dtype}")
        output_ids = [int(token) for token in ids.reshape(-1)]
        reason = required("finish_reason").reshape(-1)[0]
        reason = reason.decode() if isinstance(reason, (bytes, np.bytes_)) else str(reason)
        generation = cls(
            text=text,
            output_ids=output_ids,
            finish_reason=reason,
            num_input_tokens=scalar("num_input_tokens", int),
            num_output_tokens=scalar("num_output_tokens", int),
            kv_budget=scalar("kv_budget", int),
            peak_kv_bytes=scalar("peak_kv_bytes", int),
            tokens_evicted=scalar("tokens_evicted", int),
            compression=scalar("compression", float),
            tokens_reused=scalar("tokens_reused", int) if get("tokens_reused") is not None else 0,
            tokens_computed=scalar("tokens_computed", int) if get("tokens_computed") is not None else 0,
        )
        generation.validate(max_tokens)
        return generation

    def validate(self, max_tokens: int | None = None) -> None:
        if self.finish_reason not in FINISH_REASONS:
            raise ResponseValidationError(f"unknown finish_reason {self.finish_reason!r}")
        if self.num_output_tokens != len(self.output_ids):
            raise ResponseValidationError(
                f"num_output_tokens {self.num_output_tokens} != {len(self.output_ids)} output_ids"
            )
        if self.num_input_tokens <= 0:
            raise ResponseValidationError(f"num_input_tokens must be positive, got {self.num_input_tokens}")
        if max_tokens is not None and self.num_output_tokens > max_tokens:
            raise ResponseValidationError(f"{self.num_output_tokens} tokens generated, max_tokens was {max_tokens}")
        if self.finish_reason == "length" and max_tokens is not None and self.num_output_tokens != max_tokens:
            raise ResponseValidationError("finish_reason is length but max_tokens was not reached")
        if not 0.0 <= self.compression < 1.0 or self.tokens_evicted < 0 or self.peak_kv_bytes < 0:
            raise ResponseValidationError(
                f"cache statistics out of range: compression {self.compression}, evicted {self.tokens_evicted}, "
                f"peak bytes {self.peak_kv_bytes}"
            )


@dataclass(frozen=True)
class StreamChunk:
    """One streamed response: the newly completed text and tokens; `result` is set on the last one."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    result: Generation | None = None


def assemble_stream(chunks: list[StreamChunk], final: dict, max_tokens: int | None) -> Generation:
    """The complete, validated result of a stream: its chunks joined, statistics from the last one."""
    generation = Generation(
        text="".join(chunk.text for chunk in chunks),
        output_ids=[token for chunk in chunks for token in chunk.token_ids],
        finish_reason=str(final["finish_reason"]),
        num_input_tokens=int(final["num_input_tokens"]),
        num_output_tokens=int(final["num_output_tokens"]),
        kv_budget=int(final["kv_budget"]),
        peak_kv_bytes=int(final["peak_kv_bytes"]),
        tokens_evicted=int(final["tokens_evicted"]),
        compression=float(final["compression"]),
        tokens_reused=int(final.get("tokens_reused", 0)),
        tokens_computed=int(final.get("tokens_computed", 0)),
    )
    generation.validate(max_tokens)
    return generation
