"""What the front end (kvpop_service) checks and reshapes before a request reaches the engine.

A client request may carry a batch of N prompts; the engine generates one sequence per request, so
the front end splits it into N engine requests and answers all N together. Known request parameters
become input tensors of the engine's declared type, so a decimal such as `"temperature": 1.5` is
carried exactly and validated by the one request parser (kvpop.serving.kvpop_engine.parse). Unknown parameters
are ignored (the design guide's clients send some, e.g. `confidence_threshold`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvpop.serving.contract import SCALAR_INPUTS as SCALAR_SPECS
from kvpop.serving.kvpop_engine.parse import SCALAR_INPUTS, InvalidRequestError

# Front-end parameters that are not generation settings.
FRONTEND_ONLY = {"stream"}
MAX_BATCH_PROMPTS = 64


def engine_prompts(
    inputs: dict[str, np.ndarray], parameters: dict[str, Any], input_dtypes: dict[str, np.dtype]
) -> tuple[list[dict[str, np.ndarray]], dict[str, Any]]:
    """Split one request (inputs with a leading batch dimension) into per-prompt engine inputs.

    Returns (prompts, parameters to forward). Raises InvalidRequestError for what the front end
    cannot forward; everything else is validated by the engine.
    """
    stream = parameters.get("stream", False)
    if stream not in (False, 0, "false", "False", "0"):
        raise InvalidRequestError(
            "kvpop_service answers once per request; stream tokens with kvpop_engine "
            "(gRPC streaming or POST /v2/models/kvpop_engine/generate_stream)"
        )
    forwarded: dict[str, Any] = {}
    for key, value in parameters.items():
        if key in FRONTEND_ONLY:
            continue
        if key == "stop" and isinstance(value, list):
            if "stop" not in inputs:
                if not all(isinstance(item, str) for item in value):
                    raise InvalidRequestError("parameter stop must be a string or a list of strings")
                inputs = {**inputs, "stop": np.array([[item.encode() for item in value]], dtype=np.object_)}
            continue
        if not isinstance(value, (str, bool, int, float)):
            raise InvalidRequestError(f"parameter {key} must be a string, number or boolean, got {type(value).__name__}")
        if key in SCALAR_INPUTS and key in input_dtypes and key not in inputs:
            inputs = {**inputs, key: _scalar_tensor(key, value, input_dtypes[key])}
        elif key not in SCALAR_INPUTS:
            forwarded[key] = value

    batch_sizes = {name: array.shape[0] for name, array in inputs.items() if array.ndim >= 1}
    if not batch_sizes:
        raise InvalidRequestError("send text_input (BYTES [N, 1]) or input_ids (INT32 [N, L])")
    batch = max(batch_sizes.values())
    if batch > MAX_BATCH_PROMPTS:
        raise InvalidRequestError(f"at most {MAX_BATCH_PROMPTS} prompts per request, got {batch}")
    mismatched = {name: size for name, size in batch_sizes.items() if size not in (1, batch)}
    if mismatched:
        raise InvalidRequestError(f"inputs disagree on the batch size {batch}: {mismatched}")
    if batch > 1 and ("session_id" in inputs or "session_id" in parameters):
        raise InvalidRequestError("a session continues one conversation: send one prompt per request with session_id")
    prompts = [
        {name: array[index:index + 1] if array.shape[0] == batch else array for name, array in inputs.items()}
        for index in range(batch)
    ]
    return prompts, forwarded


def _scalar_tensor(name: str, value: Any, dtype: np.dtype) -> np.ndarray:
    """A request parameter as the engine's input tensor of shape [1, 1] (strings as BYTES)."""
    kind = SCALAR_INPUTS[name]
    if kind is str:
        if not isinstance(value, str):
            raise InvalidRequestError(f"parameter {name} must be a string, got {value!r}")
        return np.array([[value.encode("utf-8")]], dtype=np.object_)
    if kind is bool:
        if isinstance(value, str):
            value = value.strip().lower() in ("1", "true", "yes")
        return np.array([[bool(value)]], dtype=np.bool_)
    try:
        if isinstance(value, str):  # benchmark tools send numbers as strings, as the engine's parser accepts
            value = kind(value)
        return np.array([[SCALAR_SPECS[name].check(value)]], dtype=dtype)
    except ValueError as error:
        raise InvalidRequestError(f"parameter {name}: {error}") from None
