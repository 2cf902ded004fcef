"""kvpop_service: one complete answer per request, for HTTP /infer and /generate.

HTTP /infer cannot reach a decoupled model, so each request is forwarded through BLS to the
decoupled `kvpop_engine` (the one place that holds weights and KV memory) and its final response is
returned. `async def execute` lets one batch's requests wait on the engine concurrently, so the
engine batches them in flight together.
"""

import asyncio
import json

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        model_config = json.loads(args["model_config"])
        parameters = model_config.get("parameters") or {}
        self.engine_model = parameters.get("engine_model", {}).get("string_value", "kvpop_engine")
        self.input_names = [tensor["name"] for tensor in model_config["input"]]
        self.output_names = [tensor["name"] for tensor in model_config["output"]]

    async def execute(self, requests):
        return await asyncio.gather(*(self._forward(request) for request in requests))

    async def _forward(self, request):
        inputs = [
            tensor
            for tensor in (pb_utils.get_input_tensor_by_name(request, name) for name in self.input_names)
            if tensor is not None
        ]
        engine_request = pb_utils.InferenceRequest(
            model_name=self.engine_model,
            inputs=inputs,
            requested_output_names=self.output_names,
            parameters=_forwardable(json.loads(request.parameters() or "{}")),
        )
        final = None
        try:
            for response in await engine_request.async_exec(decoupled=True):
                if response.has_error():
                    return pb_utils.InferenceResponse(error=response.error())
                if response.output_tensors():
                    final = response
        except Exception as error:
            return pb_utils.InferenceResponse(
                error=pb_utils.TritonError(f"{self.engine_model} failed: {error}", pb_utils.TritonError.INTERNAL)
            )
        if final is None:
            return pb_utils.InferenceResponse(
                error=pb_utils.TritonError(f"{self.engine_model} sent no answer", pb_utils.TritonError.INTERNAL)
            )
        return pb_utils.InferenceResponse(output_tensors=final.output_tensors())


def _forwardable(parameters):
    """Request parameters BLS can carry (strings, integers, booleans); the engine validates them."""
    if not isinstance(parameters, dict):
        return {}
    return {key: value for key, value in parameters.items() if isinstance(value, (str, int, bool))}
