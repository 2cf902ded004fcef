"""The I/O contract of the two Triton models, declared once.

Every input and output tensor of `kvpop_engine` (decoupled: streams tokens) and `kvpop_service`
(complete answers), with its Triton data type, dims and meaning, and the error kinds both models send.
The request parser (kvpop.serving.kvpop_engine.parse), the output tensors (kvpop.serving.kvpop_engine.responses), the
models' error codes and the front end derive from this module; a test checks every config.pbtxt
against it, and another the client's mirror (kvpop_client.contract, installable without kvpop).
A new input is one more `TensorSpec` here and one more line in each config.pbtxt.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum
from typing import Any

import numpy as np

# Triton config data type -> (wire datatype, numpy dtype, the Python type a single value converts to).
DATA_TYPES: dict[str, tuple[str, type, type]] = {
    "TYPE_STRING": ("BYTES", np.object_, str),
    "TYPE_BOOL": ("BOOL", np.bool_, bool),
    "TYPE_INT32": ("INT32", np.int32, int),
    "TYPE_INT64": ("INT64", np.int64, int),
    "TYPE_UINT64": ("UINT64", np.uint64, int),
    "TYPE_FP32": ("FP32", np.float32, float),
}
# The values each numeric wire type carries: beyond them a value wraps or overflows on its way to a model.
WIRE_RANGES: dict[str, tuple[float, float]] = {
    "TYPE_INT32": (-(2**31), 2**31 - 1),
    "TYPE_INT64": (-(2**63), 2**63 - 1),
    "TYPE_UINT64": (0, 2**64 - 1),
    "TYPE_FP32": (-float(np.finfo(np.float32).max), float(np.finfo(np.float32).max)),
}


@dataclass(frozen=True)
class TensorSpec:
    """One input or output tensor as config.pbtxt declares it (dims exclude the batch dimension)."""

    name: str
    data_type: str  # a key of DATA_TYPES
    meaning: str
    dims: tuple[int, ...] = (1,)
    optional: bool = True  # inputs only: every input is optional (a prompt is one of three)
    ragged: bool = False  # allow_ragged_batch: requests of different lengths batch together
    unset_when_zero: bool = False  # 0, 0.0 or "" means "not sent" (perf_analyzer fills every input)
    streamed: bool = True  # outputs only: sent with every streamed token, else with the last response only

    @property
    def datatype(self) -> str:
        """The wire datatype clients send (BYTES, INT32, ...)."""
        return DATA_TYPES[self.data_type][0]

    @property
    def numpy_dtype(self) -> type:
        return DATA_TYPES[self.data_type][1]

    @property
    def python_type(self) -> type:
        return DATA_TYPES[self.data_type][2]

    @property
    def scalar(self) -> bool:
        return self.dims == (1,)

    def check(self, value: Any) -> Any:
        """`value` as this input's Python type when its wire type carries it exactly, else ValueError naming
        the input. Every client-given value passes here before it becomes a tensor: booleans are not
        numbers, an integer-valued float is an integer, and nothing wraps around."""
        kind = self.python_type
        if kind is str:
            if not isinstance(value, str) or not encodable(value):
                raise ValueError(f"{self.name} must be a UTF-8 string, got {value!r}")
            return value
        if kind is bool:
            if not isinstance(value, (bool, np.bool_)):
                raise ValueError(f"{self.name} must be a boolean, got {value!r}")
            return bool(value)
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
            raise ValueError(f"{self.name} must be a number ({self.datatype}), got {value!r}")
        if kind is int:
            if isinstance(value, (float, np.floating)) and not (math.isfinite(value) and float(value).is_integer()):
                raise ValueError(f"{self.name} must be an integer ({self.datatype}), got {value!r}")
            value = int(value)
        elif not math.isfinite(value):
            raise ValueError(f"{self.name} must be a finite number, got {value!r}")
        low, high = WIRE_RANGES[self.data_type]
        if not low <= value <= high:
            raise ValueError(f"{self.name} is out of range for {self.datatype} [{low:g}, {high:g}], got {value!r}")
        return kind(value)


@dataclass(frozen=True)
class ModelContract:
    name: str
    decoupled: bool
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]

    def input(self, name: str) -> TensorSpec:
        return next(spec for spec in self.inputs if spec.name == name)


def _input(name: str, data_type: str, meaning: str, **fields) -> TensorSpec:
    return TensorSpec(name, data_type, meaning, **fields)


# The prompt: exactly one of these per request.
PROMPT_INPUTS = (
    _input("text_input", "TYPE_STRING", "the prompt as text (a chat model's user turn unless raw_prompt)"),
    _input("messages", "TYPE_STRING", "a chat as one JSON list of {role, content}, rendered by the chat template"),
    _input("input_ids", "TYPE_INT32", "the prompt as token ids", dims=(-1,), ragged=True),
)
# Generation options, each one value; also accepted as request parameters of the same name.
OPTION_INPUTS = (
    _input("max_tokens", "TYPE_INT32", "tokens to generate at most (default: the model's default_max_tokens)",
           unset_when_zero=True),
    _input("temperature", "TYPE_FP32", "0: greedy decoding"),
    _input("top_p", "TYPE_FP32", "nucleus sampling mass (0: off)", unset_when_zero=True),
    _input("top_k", "TYPE_INT32", "sample among the k most likely tokens (0: off)"),
    _input("seed", "TYPE_UINT64", "the sampling seed (UINT64, as Triton's OpenAI frontend sends it)"),
    _input("ignore_eos", "TYPE_BOOL", "generate exactly max_tokens (benchmarks, load tests)"),
    _input("stream", "TYPE_BOOL", "one response per token (kvpop_engine only)"),
    _input("eviction_policy", "TYPE_STRING", "the KV cache policy (full, kvpop, streaming, ...)", unset_when_zero=True),
    _input("kv_budget", "TYPE_INT32", "KV slots per head kept by a bounded policy", unset_when_zero=True),
    _input("compression_ratio", "TYPE_FP32", "share of the prompt's KV evicted by a bounded policy",
           unset_when_zero=True),
    _input("session_id", "TYPE_STRING", "keep this conversation's cache between turns", unset_when_zero=True),
    _input("session_close", "TYPE_BOOL", "the session's last turn: forget it afterwards"),
    # What the TensorRT-LLM / vLLM backends take and genai-perf / perf_analyzer send. Each is honoured
    # or refused (400) when it asks for something this engine does not do; never silently ignored.
    _input("exclude_input_in_output", "TYPE_BOOL", "false: a complete answer starts with the prompt (TensorRT-LLM)"),
    _input("min_length", "TYPE_INT32", "TensorRT-LLM: 0 or absent, or equal to max_tokens", unset_when_zero=True),
    _input("min_tokens", "TYPE_INT32", "vLLM's name for min_length", unset_when_zero=True),
    _input("beam_width", "TYPE_INT32", "1 (or 0/absent): no beam search", unset_when_zero=True),
    _input("repetition_penalty", "TYPE_FP32", "1.0 (or 0/absent): no penalty", unset_when_zero=True),
    _input("presence_penalty", "TYPE_FP32", "0.0 (or absent)"),
    _input("frequency_penalty", "TYPE_FP32", "0.0 (or absent)"),
    # Triton's OpenAI frontend asks for the token counts; every response carries them anyway.
    _input("return_num_input_tokens", "TYPE_BOOL", "accepted: every response carries num_input_tokens"),
    _input("return_num_output_tokens", "TYPE_BOOL", "accepted: every response carries num_output_tokens"),
)
STOP_INPUT = _input("stop", "TYPE_STRING", "strings that end the answer (not included in it)", dims=(-1,), ragged=True)
STOP_WORDS_INPUT = _input("stop_words", "TYPE_STRING", "TensorRT-LLM's name for stop (Triton's OpenAI frontend)",
                          dims=(-1,), ragged=True)
SAMPLING_PARAMETERS_INPUT = _input(
    "sampling_parameters", "TYPE_STRING", "vLLM's options as one JSON object (SAMPLING_PARAMETER_KEYS)")
# TensorRT-LLM's guided decoding (Triton's OpenAI frontend sends it for tool calls): refused when set.
GUIDED_DECODING_INPUTS = (
    _input("guided_decoding_guide_type", "TYPE_STRING", "refused unless blank: no guided decoding"),
    _input("guided_decoding_guide", "TYPE_STRING", "refused unless blank: no guided decoding"),
)
# Inputs that hold strings besides the prompt: stop strings, vLLM's options, guided decoding.
LIST_INPUTS = (STOP_INPUT, STOP_WORDS_INPUT, SAMPLING_PARAMETERS_INPUT, *GUIDED_DECODING_INPUTS)

# Bounds a request must respect (stop strings are matched against the decoded tail every step).
MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 256
# vLLM's `sampling_parameters` keys this service reads; others are refused.
SAMPLING_PARAMETER_KEYS = frozenset({
    "max_tokens", "temperature", "top_p", "top_k", "seed", "ignore_eos", "stop", "min_tokens",
    "repetition_penalty", "presence_penalty", "frequency_penalty", "n", "best_of",
})

OUTPUTS = (
    TensorSpec("text_output", "TYPE_STRING", "the answer (a stream: the text completed by this token)"),
    TensorSpec("output_ids", "TYPE_INT64", "the answer's token ids (a stream: this token)", dims=(-1,)),
    TensorSpec("finish_reason", "TYPE_STRING", "stop, length or cancelled; empty until the last response"),
    TensorSpec("num_input_tokens", "TYPE_INT32", "prompt tokens"),
    TensorSpec("num_output_tokens", "TYPE_INT32", "tokens generated so far"),
    TensorSpec("kv_budget", "TYPE_INT32", "KV slots per head the request's cache kept", streamed=False),
    TensorSpec("peak_kv_bytes", "TYPE_INT64", "the request's largest KV footprint", streamed=False),
    TensorSpec("tokens_evicted", "TYPE_INT64", "tokens its policy evicted", streamed=False),
    TensorSpec("compression", "TYPE_FP32", "share of the sequence's KV evicted", streamed=False),
    TensorSpec("tokens_reused", "TYPE_INT32", "prompt tokens taken from a session or warm prefix", streamed=False),
    TensorSpec("tokens_computed", "TYPE_INT32", "prompt tokens this request prefilled", streamed=False),
)

ENGINE = ModelContract(
    name="kvpop_engine", decoupled=True,
    inputs=(*PROMPT_INPUTS, *OPTION_INPUTS, *LIST_INPUTS), outputs=OUTPUTS,
)
# kvpop_service answers once per request: it forwards every engine input but `stream`.
SERVICE = ModelContract(
    name="kvpop_service", decoupled=False,
    inputs=tuple(spec for spec in ENGINE.inputs if spec.name != "stream"), outputs=OUTPUTS,
)
MODELS = {model.name: model for model in (ENGINE, SERVICE)}

# name -> spec of the inputs that carry one value (the options; parsed by kvpop.serving.kvpop_engine.parse).
SCALAR_INPUTS: dict[str, TensorSpec] = {spec.name: spec for spec in OPTION_INPUTS}

FINISH_REASONS = ("stop", "length", "cancelled")


def encodable(text: str) -> bool:
    """Whether `text` can be sent as BYTES: UTF-8 has no encoding of a lone surrogate (JSON's "\\ud800")."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def unencodable_at(value: Any) -> str | None:
    """Where a decoded JSON value holds a string (or key) that is not valid text, as a dotted path ("" for
    the value itself), or None: every string a client sends must be UTF-8 on its way to the engine."""
    stack: list[tuple[Any, tuple[str, ...]]] = [(value, ())]
    while stack:
        item, path = stack.pop()
        if isinstance(item, str) and not encodable(item):
            return ".".join(path)
        children = item.items() if isinstance(item, dict) else enumerate(item) if isinstance(item, list) else ()
        for key, child in children:
            name = str(key).encode("utf-8", "backslashreplace").decode("utf-8")  # a path that is text itself
            if isinstance(key, str) and not encodable(key):
                return ".".join((*path, name))
            stack.append((child, (*path, name)))
    return None


class ErrorKind(str, Enum):
    """What went wrong with a request, and how each transport says it.

    Triton's gRPC stream delivers a model's error as a bare message, without the error code the model
    set, so every message starts with `tag`; the front end and the client read the kind back from it.
    """

    INVALID = "invalid"
    OVERLOADED = "overloaded"
    INTERNAL = "internal"

    def __str__(self) -> str:  # the value, as StrEnum (Python 3.11) would; the NGC image runs 3.10
        return self.value

    @property
    def tag(self) -> str:
        """What starts the message (kept human-readable: it is what curl users see)."""
        return {"invalid": "invalid argument: ", "overloaded": "unavailable: ", "internal": "internal: "}[self.value]

    @property
    def http_status(self) -> int:
        return {"invalid": 400, "overloaded": 503, "internal": 500}[self.value]

    @property
    def grpc_status(self) -> str:
        """The gRPC status name (what the client reports on every transport)."""
        return {"invalid": "INVALID_ARGUMENT", "overloaded": "UNAVAILABLE", "internal": "INTERNAL"}[self.value]

    @property
    def triton_code(self) -> str:
        """The name of the `pb_utils.TritonError` code a model sets."""
        return {"invalid": "INVALID_ARG", "overloaded": "UNAVAILABLE", "internal": "INTERNAL"}[self.value]
