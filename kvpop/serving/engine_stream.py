"""One generation on the engine model over Triton's gRPC stream: the one client the front end's forwarder
(kvpop.serving.kvpop_service.forwarder) and the OpenAI API (kvpop.openai_api.engine_client) share.

Input tensors are typed by the contract (kvpop.serving.contract: each input's declared datatype), the
outputs asked for are the contract's. The stream is cancelled whenever its reader stops before the
engine's final response (the client went away, a failure on the reader's side): the engine then frees the
sequence's slots at its next step. After the final response (an error response is one) it is read to its
end instead, never cancelled.
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Sequence

import numpy as np

from kvpop.serving import contract


OUTPUT_NAMES = tuple(spec.name for spec in contract.OUTPUTS)


class StreamError(Exception):
    """The engine answered the request with an error (its message carries the error's kind tag)."""


def is_final(result: Any) -> bool:
    """Whether an engine response is its last to the request (its `finish_reason` is set)."""
    finish = result.as_numpy("finish_reason")
    return finish is not None and bool(finish.reshape(-1)[0])


def engine_inputs(values: dict[str, Any]) -> dict[str, np.ndarray]:
    """The engine's input tensors for these input values (a string, a number, a bool, or a list of strings for a
    list input), each typed as the contract declares it, with Triton's leading batch dimension of 1."""
    tensors = {}
    for name, value in values.items():
        spec = contract.ENGINE.input(name)
        items = value if isinstance(value, (list, tuple)) else [value]
        if spec.numpy_dtype is np.object_:
            items = [item.encode("utf-8") if isinstance(item, str) else item for item in items]
        tensors[name] = np.array([items], dtype=spec.numpy_dtype)
    return tensors


async def stream_generate(client: Any, inputs: dict[str, np.ndarray], parameters: dict | None = None,
                          output_names: Sequence[str] = OUTPUT_NAMES, model_name: str = contract.ENGINE.name,
                          ) -> AsyncIterator[Any]:
    """Yield each of the engine's responses (tritonclient InferResult) to one request, the final one (its
    `finish_reason` set) last. `client`: a tritonclient.grpc.aio.InferenceServerClient; `output_names`: the
    contract's outputs to ask for. Raises StreamError on an error response (the request's last); stopping
    before the final response cancels the stream."""
    import tritonclient.grpc as grpc_client
    from tritonclient.utils import np_to_triton_dtype

    tensors = []
    for name, array in inputs.items():
        tensor = grpc_client.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
        tensor.set_data_from_numpy(array)
        tensors.append(tensor)
    outputs = [grpc_client.InferRequestedOutput(name) for name in output_names]

    async def one_request():
        yield {"model_name": model_name, "inputs": tensors, "outputs": outputs, "parameters": parameters or None}

    responses = client.stream_infer(one_request())
    finished = False
    try:
        async for result, error in responses:
            if error is not None:  # the engine's last response to the request (it sends errors as final)
                finished = True
                await _until_closed(responses)
                raise StreamError(str(error.message() if hasattr(error, "message") else error))
            finished = is_final(result)
            if finished:
                await _until_closed(responses)
            yield result
            if finished:
                return
    finally:
        if not finished:
            responses.cancel()


async def _until_closed(responses: Any, timeout: float = 5.0) -> None:
    """Read the stream to its end after the request's last response (the server closes it at once: the
    request was our only one). Cancelling a stream whose request has just completed races tritonserver's own
    completion of it: its stream handler then waits for a callback that never comes, and the engine model
    can never unload (tritonserver runs into its exit timeout on every stop)."""

    async def rest() -> None:
        async for _ in responses:
            pass

    try:
        await asyncio.wait_for(rest(), timeout)
    except Exception:  # timed out or broken: nothing more is owed
        responses.cancel()
