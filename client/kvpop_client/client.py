"""`KVpopClient`: one object for HTTP and gRPC, built on the official tritonclient packages."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from kvpop_client.errors import KVpopServerError
from kvpop_client.types import Generation

MODEL_NAME = "kvpop_service"
DEFAULT_URLS = {"http": "localhost:8000", "grpc": "localhost:8001"}

# Optional request inputs: name -> (Triton datatype, numpy dtype).
OPTIONAL_INPUTS: dict[str, tuple[str, Any]] = {
    "max_tokens": ("INT32", np.int32),
    "temperature": ("FP32", np.float32),
    "top_p": ("FP32", np.float32),
    "top_k": ("INT32", np.int32),
    "seed": ("INT64", np.int64),
    "eviction_policy": ("BYTES", np.object_),
    "kv_budget": ("INT32", np.int32),
    "compression_ratio": ("FP32", np.float32),
}


class KVpopClient:
    """Send generation requests to `kvpop_service` over "http" or "grpc".

    Every input gets Triton's leading batch dimension of 1 (the model batches dynamically).
    """

    def __init__(self, url: str | None = None, protocol: str = "http", model: str = MODEL_NAME, timeout: float = 300.0):
        if protocol not in DEFAULT_URLS:
            raise ValueError(f"protocol must be 'http' or 'grpc', got {protocol!r}")
        self.protocol, self.model, self.timeout = protocol, model, timeout
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

    # Health -----------------------------------------------------------------------------------
    def is_ready(self) -> bool:
        try:
            return bool(self._client.is_server_ready() and self._client.is_model_ready(self.model))
        except Exception:
            return False

    # Generation -------------------------------------------------------------------------------
    def build_inputs(self, prompt: str | Sequence[int], stop: Sequence[str] = (), **options: Any) -> list:
        triton = self._triton
        if isinstance(prompt, str):
            data = np.array([[prompt.encode("utf-8")]], dtype=np.object_)
            inputs = [triton.InferInput("text_input", list(data.shape), "BYTES")]
        else:
            data = np.asarray(prompt, dtype=np.int64).reshape(1, -1)  # int32 ids are widened to the wire type
            inputs = [triton.InferInput("input_ids", list(data.shape), "INT64")]
        inputs[0].set_data_from_numpy(data)
        if stop:
            stop_data = np.array([[item.encode("utf-8") for item in stop]], dtype=np.object_)
            inputs.append(triton.InferInput("stop", list(stop_data.shape), "BYTES"))
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

    def generate(self, prompt: str | Sequence[int], max_tokens: int | None = None, stop: Sequence[str] = (), **options: Any) -> Generation:
        """One complete answer. `options`: temperature, top_p, top_k, seed, eviction_policy, kv_budget,
        compression_ratio."""
        inputs = self.build_inputs(prompt, stop=stop, max_tokens=max_tokens, **options)
        try:
            if self.protocol == "http":
                result = self._client.infer(self.model, inputs, timeout=int(self.timeout * 1e6))
            else:
                result = self._client.infer(self.model, inputs, client_timeout=self.timeout)
        except self._triton.InferenceServerException as error:
            raise KVpopServerError(error.message(), error.status()) from None
        return Generation.from_outputs(lambda name: _first(result.as_numpy(name)), max_tokens)


def _first(array: np.ndarray | None) -> np.ndarray | None:
    """Drop the batch dimension of 1."""
    return None if array is None else array[0]
