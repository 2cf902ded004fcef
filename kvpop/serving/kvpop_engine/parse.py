"""Turn one Triton request's tensors and parameters into an engine `GenerationRequest`, a piece per concern
of the contract (kvpop.serving.contract): the prompt (kvpop.serving.kvpop_engine.prompt), the one-value
options, the stop strings, sampling, the cache and its policy's options, the session.

Everything a client can get wrong is checked here and raised as `InvalidRequestError` with a message
that names the input, so `model.py` can answer that request alone with an error and carry on.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import numpy as np

from kvpop.policies import policy_defaults
from kvpop.request import CacheConfig, GenerationRequest, SamplingParams
from kvpop.serving import contract
from kvpop.serving.contract import MAX_STOP_LENGTH, MAX_STOP_STRINGS, SAMPLING_PARAMETER_KEYS
from kvpop.serving.errors import InvalidRequestError
from kvpop.serving.kvpop_engine.config import ServiceConfig
from kvpop.serving.kvpop_engine.prompt import blank, decode_utf8, read_prompt


# Inputs that carry one value, name -> the Python type it converts to; those whose zero value
# (0, 0.0 or "") means "not sent". Declared in kvpop.serving.contract.
SCALAR_INPUTS: dict[str, type] = {name: spec.python_type for name, spec in contract.SCALAR_INPUTS.items()}
UNSET_WHEN_ZERO = tuple(name for name, spec in contract.SCALAR_INPUTS.items() if spec.unset_when_zero)

# Stop strings: `stop` (this service, vLLM) or `stop_words` (TensorRT-LLM, Triton's OpenAI frontend).
STOP_INPUTS = (contract.STOP_INPUT.name, contract.STOP_WORDS_INPUT.name)
# TensorRT-LLM's guided decoding: refused when asked for.
GUIDED_DECODING_INPUTS = tuple(spec.name for spec in contract.GUIDED_DECODING_INPUTS)


@dataclass
class ParsedRequest:
    generation: GenerationRequest
    stream: bool
    echo_prompt: bool = False  # exclude_input_in_output=false: the answer starts with the prompt


def _scalar(name: str, tensor: np.ndarray | None, parameter: Any) -> Any:
    """One value from a tensor input or, failing that, a request parameter of the same name (checked
    against the input's wire type: kvpop.serving.contract.TensorSpec.check)."""
    kind = SCALAR_INPUTS[name]
    if tensor is not None:
        if tensor.size != 1:
            raise InvalidRequestError(f"{name} must hold exactly one value, got shape {list(tensor.shape)}")
        value = tensor.reshape(-1)[0]
        if kind is str:
            return decode_utf8(value, name)
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
    if kind is bool:
        return parameter.strip().lower() in ("1", "true", "yes") if isinstance(parameter, str) else bool(parameter)
    if kind is str:
        return decode_utf8(parameter if isinstance(parameter, str) else str(parameter), f"parameter {name}")
    try:
        if isinstance(parameter, str):  # benchmark tools send numbers as strings (genai-perf: "max_tokens": "8")
            parameter = kind(parameter)
        return contract.SCALAR_INPUTS[name].check(parameter)
    except ValueError as error:
        raise InvalidRequestError(f"parameter {name}: {error}") from None


def parse_parameters(text: str | None) -> dict[str, Any]:
    if not text:
        return {}
    try:
        parameters = json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        raise InvalidRequestError("request parameters are not valid JSON") from None
    where = contract.unencodable_at(parameters)
    if where is not None:
        raise InvalidRequestError(f"request parameter {where or 'value'} is not valid UTF-8 text (it holds a lone surrogate)")
    return parameters if isinstance(parameters, dict) else {}


def parse_request(
    request_id: str,
    get_input: Callable[[str], np.ndarray | None],
    parameters: dict[str, Any],
    tokenizer,
    vocab_size: int,
    config: ServiceConfig,
    policy_options: Mapping[str, Any] | None = None,
) -> ParsedRequest:
    """Validate inputs and build the engine request, one concern of the contract at a time: the prompt, the
    one-value options, the stop strings, sampling, the cache, the session. `get_input(name)` returns a numpy
    array or None. `policy_options`: every request's options by policy name (kvpop.policies.registry.policy_defaults;
    None: the deployment's settings on a model without policy assets)."""
    parameters = _merge_sampling_parameters(get_input("sampling_parameters"), parameters)
    prompt_ids = read_prompt(get_input, parameters, tokenizer, vocab_size, config)
    values = _option_values(get_input, parameters)
    sampling = _sampling(values, _stop_strings(get_input, parameters), config)
    try:
        cache = request_cache_config(values["eviction_policy"] or config.default_policy, values["kv_budget"],
                                     values["compression_ratio"], config, policy_options)
    except ValueError as error:
        raise InvalidRequestError(str(error)) from None
    generation = GenerationRequest(request_id=request_id, prompt_ids=prompt_ids, sampling=sampling, cache=cache,
                                   session_id=_session_id(values), end_session=bool(values["session_close"]))
    echo_prompt = values["exclude_input_in_output"] is False
    if echo_prompt and values["stream"]:
        raise InvalidRequestError("exclude_input_in_output=false is supported for complete answers only, not streams")
    return ParsedRequest(generation=generation, stream=bool(values["stream"]), echo_prompt=echo_prompt)


def _option_values(get_input: Callable[[str], np.ndarray | None], parameters: dict[str, Any]) -> dict[str, Any]:
    """The contract's one-value inputs (an input tensor, else a request parameter of the same name), None where
    not sent; guided decoding, which the contract declares only to refuse, refused."""
    values = {name: _scalar(name, get_input(name), parameters.get(name)) for name in SCALAR_INPUTS}
    # perf_analyzer fills every optional input with zeros or empty strings: where zero or "" is not a
    # meaningful setting it means "not sent" (max_tokens 0 is the default, eviction_policy "" too).
    for name in UNSET_WHEN_ZERO:
        if values[name] in (0, 0.0) or (isinstance(values[name], str) and blank(values[name])):
            values[name] = None
    if values["kv_budget"] is not None and values["kv_budget"] < 0:
        raise InvalidRequestError(f"kv_budget must be >= 1 slot per head (0 or absent: the default), got {values['kv_budget']}")
    for name in GUIDED_DECODING_INPUTS:
        guide = get_input(name)
        if guide is not None and any(not blank(decode_utf8(item, name)) for item in guide.reshape(-1)):
            raise InvalidRequestError(f"{name}: guided decoding is not supported by this engine")
    return values


def _stop_strings(get_input: Callable[[str], np.ndarray | None], parameters: dict[str, Any]) -> tuple[str, ...]:
    """The contract's stop inputs (`stop`, `stop_words`), else a `stop` parameter; blank ones dropped, bounded."""
    stop_tensors = [(name, get_input(name)) for name in STOP_INPUTS]
    stop: tuple[str, ...] = tuple(decode_utf8(item, name) for name, tensor in stop_tensors if tensor is not None
                                  for item in tensor.reshape(-1))
    if all(tensor is None for _, tensor in stop_tensors) and isinstance(parameters.get("stop"), (list, str)):
        stop = tuple([parameters["stop"]] if isinstance(parameters["stop"], str) else map(str, parameters["stop"]))
    stop = tuple(item for item in stop if item.strip(" \x00"))  # "" or spaces (perf_analyzer's filler): none
    # Stop strings are matched against the decoded tail every step: bound their cost.
    if len(stop) > MAX_STOP_STRINGS or any(len(item) > MAX_STOP_LENGTH for item in stop):
        raise InvalidRequestError(f"stop takes at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_LENGTH} characters")
    return stop


def _sampling(values: dict[str, Any], stop: tuple[str, ...], config: ServiceConfig) -> SamplingParams:
    max_tokens = values["max_tokens"] if values["max_tokens"] is not None else config.default_max_tokens
    if not 1 <= max_tokens <= config.max_output_tokens:
        raise InvalidRequestError(f"max_tokens must be in [1, {config.max_output_tokens}], got {max_tokens}")
    ignore_eos = bool(values["ignore_eos"]) or _check_tool_inputs(values, max_tokens)
    try:
        return SamplingParams(
            temperature=values["temperature"] if values["temperature"] is not None else 0.0,
            top_p=values["top_p"] if values["top_p"] is not None else 1.0,
            top_k=values["top_k"] if values["top_k"] is not None else 0,
            seed=values["seed"],
            max_tokens=max_tokens,
            stop=stop,
            ignore_eos=ignore_eos,
        )
    except ValueError as error:
        raise InvalidRequestError(str(error)) from None


def _session_id(values: dict[str, Any]) -> str | None:
    session_id = values["session_id"]
    if session_id is not None:
        from kvpop.sessions import InvalidSessionId, validate_session_id

        try:
            validate_session_id(session_id)
        except InvalidSessionId as error:
            raise InvalidRequestError(str(error)) from None
    elif values["session_close"]:
        raise InvalidRequestError("session_close needs a session_id")
    return session_id


def request_cache_config(
    policy: str, budget: int | None, compression: float | None, config: ServiceConfig,
    policy_options: Mapping[str, Any] | None = None,
) -> CacheConfig:
    """The cache a request gets (a bounded policy with neither budget nor ratio: the default budget), with
    its policy's options (`parse_request`). Warm prefixes are prefilled for exactly these configurations."""
    if policy == "full":
        if budget is not None or compression is not None:
            raise InvalidRequestError("eviction_policy 'full' keeps every token: omit kv_budget and compression_ratio")
    elif budget is None and compression is None:
        budget = config.default_kv_budget
    if policy_options is None:
        policy_options = policy_defaults(config.policy_settings, {})
    return CacheConfig(policy=policy, budget=budget, compression=compression, options=policy_options.get(policy))


def _merge_sampling_parameters(tensor: np.ndarray | None, parameters: dict[str, Any]) -> dict[str, Any]:
    """vLLM's `sampling_parameters` (a JSON object, input tensor or request parameter) as request
    parameters; a request parameter of the same name wins."""
    raw = tensor.reshape(-1)[0] if tensor is not None and tensor.size == 1 else parameters.get("sampling_parameters")
    if tensor is not None and tensor.size != 1:
        raise InvalidRequestError(f"sampling_parameters must hold one JSON string, got shape {list(tensor.shape)}")
    if raw is None:
        return parameters
    if isinstance(raw, dict):
        sampling = raw
    else:
        text = decode_utf8(raw, "sampling_parameters")
        if blank(text):
            return parameters
        try:
            sampling = json.loads(text)
        except (json.JSONDecodeError, RecursionError):
            raise InvalidRequestError(f"sampling_parameters is not valid JSON: {text[:40]!r}") from None
    where = contract.unencodable_at(sampling)
    if where is not None:
        raise InvalidRequestError(f"sampling_parameters.{where} is not valid UTF-8 text (it holds a lone surrogate)")
    if not isinstance(sampling, dict):
        raise InvalidRequestError("sampling_parameters must be a JSON object")
    unknown = sorted(set(sampling) - SAMPLING_PARAMETER_KEYS)
    if unknown:
        raise InvalidRequestError(f"sampling_parameters: unsupported keys {unknown}")
    for key in ("n", "best_of"):
        if sampling.get(key, 1) not in (1, None):
            raise InvalidRequestError(f"sampling_parameters.{key} must be 1: one sequence per request")
    merged = {key: value for key, value in sampling.items() if key not in ("n", "best_of") and value is not None}
    merged.update({key: value for key, value in parameters.items() if key != "sampling_parameters"})
    return merged


def _check_tool_inputs(values: dict[str, Any], max_tokens: int) -> bool:
    """Refuse what the TensorRT-LLM / vLLM style inputs ask for that this engine does not do.
    Returns True when a minimum length asks for exactly max_tokens tokens (generate them: ignore EOS)."""
    if values["beam_width"] not in (None, 0, 1):
        raise InvalidRequestError(f"beam_width must be 1: this engine does not do beam search, got {values['beam_width']}")
    if values["repetition_penalty"] not in (None, 0.0, 1.0):
        raise InvalidRequestError(f"repetition_penalty is not supported (send 1.0 or omit it), got {values['repetition_penalty']}")
    for name in ("presence_penalty", "frequency_penalty"):
        if values[name] not in (None, 0.0):
            raise InvalidRequestError(f"{name} is not supported (send 0 or omit it), got {values[name]}")
    exact = False
    for name in ("min_length", "min_tokens"):
        minimum = values[name]
        if minimum is None or minimum == 0:
            continue
        if minimum < 0:
            raise InvalidRequestError(f"{name} must be >= 0, got {minimum}")
        if minimum > max_tokens:
            raise InvalidRequestError(f"{name} ({minimum}) is larger than max_tokens ({max_tokens})")
        if minimum != max_tokens:
            raise InvalidRequestError(
                f"{name} is supported only equal to max_tokens (exactly that many tokens, as benchmarks ask), "
                f"got {name}={minimum}, max_tokens={max_tokens}; or use ignore_eos")
        exact = True
    return exact


__all__ = ["InvalidRequestError", "ParsedRequest", "parse_parameters", "parse_request", "request_cache_config"]
