"""kvpop_service: one complete answer per request, for HTTP /infer and /generate.

HTTP /infer cannot reach a decoupled model, so each request is forwarded through BLS to the
decoupled `kvpop_engine` (the one place that holds weights and KV memory), and its final response is
sent back through the request's response sender. `execute` returns at once: each request is
answered as soon as its own generation ends, never held back by a longer request that arrived in the
same batch, and the engine batches all of them in flight.
"""

import json
from concurrent.futures import ThreadPoolExecutor

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        model_config = json.loads(args["model_config"])
        parameters = {key: value["string_value"] for key, value in (model_config.get("parameters") or {}).items()}
        self.engine_model = parameters.get("engine_model", "kvpop_engine")
        max_in_flight = int(parameters.get("max_in_flight_requests", "256"))
        self.input_names = [tensor["name"] for tensor in model_config["input"]]
        self.output_names = [tensor["name"] for tensor in model_config["output"]]
        # Each in-flight request waits on the engine in one of these threads (BLS calls block).
        self.pool = ThreadPoolExecutor(max_workers=max_in_flight, thread_name_prefix="kvpop-forward")

    def execute(self, requests):
        for request in requests:
            self.pool.submit(self._answer, request, request.get_response_sender())
        return None

    def _answer(self, request, sender):
        try:
            response = self._forward(request)
        except Exception as error:  # the request fails, the model stays up
            response = _error(f"{self.engine_model} failed: {error}", pb_utils.TritonError.INTERNAL)
        sender.send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def _forward(self, request):
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
        for response in engine_request.exec(decoupled=True):
            if response.has_error():  # keep the engine's error code (invalid argument, unavailable)
                error = response.error()
                return _error(error.message(), error.code())
            if response.output_tensors():
                final = response
        if final is None:
            return _error(f"{self.engine_model} sent no answer", pb_utils.TritonError.INTERNAL)
        return pb_utils.InferenceResponse(output_tensors=final.output_tensors())

    def finalize(self):
        self.pool.shutdown(wait=True, cancel_futures=False)


def _error(message, code):
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code))


def _forwardable(parameters):
    """Request parameters BLS can carry (strings, integers, booleans); the engine validates them."""
    if not isinstance(parameters, dict):
        return {}
    return {key: value for key, value in parameters.items() if isinstance(value, (str, int, bool))}
