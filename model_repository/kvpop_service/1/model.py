"""kvpop_service: one complete answer per request, for HTTP /infer and /generate.

HTTP /infer cannot reach a decoupled model, so each request is forwarded through BLS to the
decoupled `kvpop_engine` (the one place that holds weights and KV memory), and its final response is
sent back through the request's response sender. `execute` returns at once: each request is
answered as soon as its own generation ends, never held back by a longer request that arrived in the
same batch, and the engine batches all of them in flight. A BLS call cannot be cancelled in Triton
2.51, so when a client goes away a watcher thread tells the engine to cancel that request.
"""

import json
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import triton_python_backend_utils as pb_utils

from kvpop.serving.config import CANCEL_PARAMETER  # no heavy imports: this model holds no weights
CANCEL_POLL_SECONDS = 0.05


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
        self.in_flight = {}  # engine request id -> the client's request, while it waits on the engine
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.watcher = threading.Thread(target=self._watch_cancellations, name="kvpop-cancel-watch", daemon=True)
        self.watcher.start()

    def execute(self, requests):
        for request in requests:
            self.pool.submit(self._answer, request, request.get_response_sender())
        return None

    def _answer(self, request, sender):
        engine_request_id = uuid.uuid4().hex
        with self.lock:
            self.in_flight[engine_request_id] = request
        try:
            response = self._forward(request, engine_request_id)
        except Exception as error:  # the request fails, the model stays up
            response = _error(f"{self.engine_model} failed: {error}", pb_utils.TritonError.INTERNAL)
        finally:
            with self.lock:
                self.in_flight.pop(engine_request_id, None)
        sender.send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def _watch_cancellations(self):
        cancelled = set()
        while not self.stopping.wait(CANCEL_POLL_SECONDS):
            with self.lock:
                gone = [rid for rid, request in self.in_flight.items() if rid not in cancelled and request.is_cancelled()]
            for engine_request_id in gone:
                cancelled.add(engine_request_id)
                try:
                    # A request needs an input to be batched by the engine's scheduler; it is not run.
                    control = pb_utils.InferenceRequest(
                        model_name=self.engine_model,
                        inputs=[pb_utils.Tensor("input_ids", np.zeros((1, 1), np.int64))],
                        requested_output_names=["finish_reason"],
                        parameters={CANCEL_PARAMETER: engine_request_id},
                    )
                    for _ in control.exec(decoupled=True):
                        pass
                except Exception:  # the engine may be unloading; nothing left to free then
                    pass
            with self.lock:
                cancelled &= set(self.in_flight)

    def _forward(self, request, engine_request_id):
        inputs = [
            tensor
            for tensor in (pb_utils.get_input_tensor_by_name(request, name) for name in self.input_names)
            if tensor is not None
        ]
        engine_request = pb_utils.InferenceRequest(
            model_name=self.engine_model,
            inputs=inputs,
            requested_output_names=self.output_names,
            request_id=engine_request_id,
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
        self.stopping.set()
        self.watcher.join(5)
        self.pool.shutdown(wait=True, cancel_futures=False)


def _error(message, code):
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code))


def _forwardable(parameters):
    """Request parameters BLS can carry (strings, integers, booleans); the engine validates them."""
    if not isinstance(parameters, dict):
        return {}
    return {key: value for key, value in parameters.items() if isinstance(value, (str, int, bool))}
