"""Turn one Triton request's tensors and parameters into an engine `GenerationRequest`.

Everything a client can get wrong is checked here and raised as `InvalidRequestError` with a message
that names the input, so `model.py` can answer that request alone with an error and carry on.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from kvpop.engine import CacheConfig, GenerationRequest, SamplingParams
from kvpop.serving.config import ServiceConfig


class InvalidRequestError(ValueError):
    """The request is malformed; the message is sent back to the client."""


# Optional inputs, each a single value, with the Python type it must convert to.
SCALAR_INPUTS: dict[str, type] = {
    "max_tokens": int,
    "temperature": float,
    "top_p": float,
    "top_k": int,
    "seed": int,
    "stream": bool,
    "ignore_eos": bool,  # generate exactly max_tokens (benchmarks, load tests)
    "eviction_policy": str,
    "kv_budget": int,
    "compression_ratio": float,
    "session_id": str,  # keep this conversation's cache between turns (kvpop.sessions)
    "session_close": bool,  # the session's last turn: forget it afterwards
}


MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 256


@dataclass
class ParsedRequest:
    generation: GenerationRequest
    stream: bool


def _decode_utf8(value: Any, name: str) -> str:
    if isinstance(value, (bytes, np.bytes_)):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError as error:
            raise InvalidRequestError(f"{name} is not valid UTF-8 ({error.reason} at byte {error.start})") from None
    if isinstance(value, str):
        return value
    raise InvalidRequestError(f"{name} must be BYTES (a UTF-8 string), got {type(value).__name__}")


def _scalar(name: str, tensor: np.ndarray | None, parameter: Any) -> Any:
    """One value from a tensor input or, failing that, a request parameter of the same name."""
    kind = SCALAR_INPUTS[name]
    if tensor is not None:
        if tensor.size != 1:
            raise InvalidRequestError(f"{name} must hold exactly one value, got shape {list(tensor.shape)}")
        value = tensor.reshape(-1)[0]
        if kind is str:
            return _decode_utf8(value, name)
        if kind is bool:
            return bool(value)
        if kind is int and not np.issubdtype(np.asarray(value).dtype, np.integer):
            raise InvalidRequestError(f"{name} must be an integer, got {value!r}")
        try:
            return kind(value)
        except (TypeError, ValueError):
            raise InvalidRequestError(f"{name} must be {kind.__name__}, got {value!r}") from None
    if parameter is None:
        return None
    if kind is bool and isinstance(parameter, str):
        return parameter.strip().lower() in ("1", "true", "yes")
    if kind is int and isinstance(parameter, float) and not parameter.is_integer():
        raise InvalidRequestError(f"{name} must be an integer, got {parameter!r}")
    try:
        return kind(parameter)
    except (TypeError, ValueError):
        raise InvalidRequestError(f"parameter {name} must be {kind.__name__}, got {parameter!r}") from None


def parse_parameters(text: str | None) -> dict[str, Any]:
    if not text:
        return {}
    try:
        parameters = json.loads(text)
    except json.JSONDecodeError:
        raise InvalidRequestError("request parameters are not valid JSON") from None
    return parameters if isinstance(parameters, dict) else {}


def chat_prompt(get_input: Callable[[str], np.ndarray | None], parameters: dict[str, Any], tokenizer) -> np.ndarray | None:
    """The `messages` input (one BYTES element of JSON, or a request parameter) rendered by the model's
    chat template, as a `text_input` tensor; None when the request has no messages."""
    from kvpop.serving.chat import InvalidMessagesError, parse_messages, render_chat

    tensor = get_input("messages")
    if tensor is None and "messages" not in parameters:
        return None
    if tensor is not None and tensor.size != 1:
        raise InvalidRequestError(f"messages must hold exactly one JSON string, got shape {list(tensor.shape)}")
    raw = tensor.reshape(-1)[0] if tensor is not None else parameters["messages"]
    try:
        return np.array([render_chat(parse_messages(raw), tokenizer)], dtype=object)
    except InvalidMessagesError as error:
        raise InvalidRequestError(str(error)) from None


def parse_request(
    request_id: str,
    get_input: Callable[[str], np.ndarray | None],
    parameters: dict[str, Any],
    tokenizer,
    vocab_size: int,
    config: ServiceConfig,
    kvpop_scorer: str = "accumulated_attention",
) -> ParsedRequest:
    """Validate inputs and build the engine request. `get_input(name)` returns a numpy array or None."""
    text = get_input("text_input")
    ids = get_input("input_ids")
    if text is None and "text_input" in parameters:
        text = np.array([parameters["text_input"]], dtype=object)
    chat = chat_prompt(get_input, parameters, tokenizer)
    if chat is not None:
        if text is not None or ids is not None:
            raise InvalidRequestError("send exactly one of text_input, input_ids or messages")
        text = chat
    if (text is None) == (ids is None):
        raise InvalidRequestError("send exactly one of text_input (BYTES) or input_ids (INT32 [1, N])")

    if text is not None:
        if text.size != 1:
            raise InvalidRequestError(f"text_input must hold exactly one string, got shape {list(text.shape)}")
        prompt = _decode_utf8(text.reshape(-1)[0], "text_input")
        if not prompt.strip():
            raise InvalidRequestError("text_input is empty")
        if len(prompt) > config.max_prompt_tokens * 32:  # refuse absurd payloads before tokenizing
            raise InvalidRequestError(f"text_input is too long ({len(prompt)} characters)")
        prompt_ids = list(tokenizer(prompt).input_ids)
    else:
        if not np.issubdtype(ids.dtype, np.integer):
            raise InvalidRequestError(f"input_ids must be INT32 or INT64, got {ids.dtype}")
        if ids.size > config.max_prompt_tokens:  # refuse before converting a huge payload
            raise InvalidRequestError(
                f"prompt has {ids.size} tokens; this service accepts at most {config.max_prompt_tokens}"
            )
        prompt_ids = [int(token) for token in ids.reshape(-1)]
        if not prompt_ids:
            raise InvalidRequestError("input_ids is empty")
        bad = [token for token in prompt_ids if not 0 <= token < vocab_size]
        if bad:
            raise InvalidRequestError(f"input_ids out of range [0, {vocab_size}): {bad[:5]}")
    if not prompt_ids:
        raise InvalidRequestError("the prompt is empty after tokenization")
    if len(prompt_ids) > config.max_prompt_tokens:
        raise InvalidRequestError(
            f"prompt has {len(prompt_ids)} tokens; this service accepts at most {config.max_prompt_tokens}"
        )

    values = {name: _scalar(name, get_input(name), parameters.get(name)) for name in SCALAR_INPUTS}
    stop_tensor = get_input("stop")
    stop: tuple[str, ...] = ()
    if stop_tensor is not None:
        stop = tuple(_decode_utf8(item, "stop") for item in stop_tensor.reshape(-1))
    elif isinstance(parameters.get("stop"), (list, str)):
        stop = tuple([parameters["stop"]] if isinstance(parameters["stop"], str) else map(str, parameters["stop"]))
    stop = tuple(item for item in stop if item)
    # Stop strings are matched against the decoded tail every step: bound their cost.
    if len(stop) > MAX_STOP_STRINGS or any(len(item) > MAX_STOP_LENGTH for item in stop):
        raise InvalidRequestError(f"stop takes at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_LENGTH} characters")

    max_tokens = values["max_tokens"] if values["max_tokens"] is not None else config.default_max_tokens
    if not 1 <= max_tokens <= config.max_output_tokens:
        raise InvalidRequestError(f"max_tokens must be in [1, {config.max_output_tokens}], got {max_tokens}")
    try:
        sampling = SamplingParams(
            temperature=values["temperature"] if values["temperature"] is not None else 0.0,
            top_p=values["top_p"] if values["top_p"] is not None else 1.0,
            top_k=values["top_k"] if values["top_k"] is not None else 0,
            seed=values["seed"],
            max_tokens=max_tokens,
            stop=stop,
            ignore_eos=bool(values["ignore_eos"]),
        )
        policy = values["eviction_policy"] or config.default_policy
        budget, compression = values["kv_budget"], values["compression_ratio"]
        if policy == "full":
            if budget is not None or compression is not None:
                raise InvalidRequestError("eviction_policy 'full' keeps every token: omit kv_budget and compression_ratio")
        elif budget is None and compression is None:
            budget = config.default_kv_budget
        cache = CacheConfig(policy=policy, budget=budget, compression=compression, scorer=kvpop_scorer)
    except ValueError as error:
        raise InvalidRequestError(str(error)) from None
    session_id = values["session_id"]
    if session_id is not None:
        from kvpop.sessions import InvalidSessionId, validate_session_id

        try:
            validate_session_id(session_id)
        except InvalidSessionId as error:
            raise InvalidRequestError(str(error)) from None
    elif values["session_close"]:
        raise InvalidRequestError("session_close needs a session_id")
    generation = GenerationRequest(request_id=request_id, prompt_ids=prompt_ids, sampling=sampling, cache=cache,
                                   session_id=session_id, end_session=bool(values["session_close"]))
    return ParsedRequest(generation=generation, stream=bool(values["stream"]))
