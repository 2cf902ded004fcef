"""kvpop_service: one complete answer per request, for HTTP /infer and /generate (and gRPC infer).

HTTP /infer cannot reach a decoupled model, so each request is forwarded to the decoupled
`kvpop_engine` (the one place that holds weights and KV memory) over a loopback gRPC stream per
prompt, and answered as soon as its own generation ends (kvpop.serving.kvpop_service.forwarder says why not BLS).
`execute` copies the inputs and returns at once; the engine batches all requests in flight. A watcher
thread notices clients that went away and cancels their engine streams.
"""

import json
import os
import threading
from dataclasses import dataclass, field

import numpy as np
import triton_python_backend_utils as pb_utils

# Light imports only: this model holds no weights.
from kvpop.serving.contract import ErrorKind
from kvpop.serving.errors import InvalidRequestError, tagged
from kvpop.serving.kvpop_engine.parse import parse_parameters
from kvpop.serving.kvpop_service.forwarder import EngineForwarder, ForwardError, ForwardJob
from kvpop.serving.kvpop_service.frontend import engine_prompts
from kvpop.serving.process.drain import DrainSignal
from kvpop.serving.process.stubs import exit_with_server

CANCEL_POLL_SECONDS = 0.1


@dataclass
class _HeldRequest:
    request: object  # the client's request, kept for is_cancelled()
    sender: object
    answered: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)


class TritonPythonModel:
    def initialize(self, args):
        exit_with_server()  # a stub that lost its server mid-request would otherwise never exit
        model_config = json.loads(args["model_config"])
        parameters = {key: value["string_value"] for key, value in (model_config.get("parameters") or {}).items()}
        try:
            max_in_flight = int(parameters.get("max_in_flight_requests", "1024"))
            if max_in_flight <= 0:
                raise ValueError
        except ValueError:
            raise pb_utils.TritonModelException("kvpop_service: max_in_flight_requests must be an integer > 0") from None
        # The launcher tells the model where this server's own gRPC endpoint is.
        url = os.environ.get("KVPOP_ENGINE_GRPC_URL") or parameters.get("engine_grpc_url", "127.0.0.1:8001")
        self.input_dtypes = {
            tensor["name"]: np.dtype(pb_utils.triton_string_to_numpy(tensor["data_type"]))
            for tensor in model_config["input"]
        }
        self.output_dtypes = {
            tensor["name"]: pb_utils.triton_string_to_numpy(tensor["data_type"]) for tensor in model_config["output"]
        }
        self.forwarder = EngineForwarder(url, parameters.get("engine_model", "kvpop_engine"), max_in_flight,
                                         output_names=list(self.output_dtypes))
        self.in_flight = {}  # job id -> the client's request, while the engine works on it
        # The family must outlive its metric (the stub refuses, and the server may crash, otherwise).
        self.in_flight_family = pb_utils.MetricFamily(
            name="kvpop_frontend_in_flight_requests",
            description="requests kvpop_service is waiting on the engine for (its queue is the engine's)",
            kind=pb_utils.MetricFamily.GAUGE,
        )
        self.in_flight_gauge = self.in_flight_family.Metric(
            labels={"model": args["model_name"], "instance": args["model_instance_name"]})
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.drain = DrainSignal()  # the supervisor's: past its deadline, whatever still waits fails now
        self.watcher = threading.Thread(target=self._watch_cancellations, name="kvpop-cancel-watch", daemon=True)
        self.watcher.start()

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                inputs = {}
                for name in self.input_dtypes:
                    tensor = pb_utils.get_input_tensor_by_name(request, name)
                    if tensor is not None:
                        inputs[name] = np.array(tensor.as_numpy(), copy=True)  # owned by us, not the stub
                prompts, parameters = engine_prompts(inputs, parse_parameters(request.parameters()), self.input_dtypes)
                held = _HeldRequest(request, sender)
                job = ForwardJob(prompts, parameters, on_done=self._answer, context=held)
                with self.lock:  # registered before it can finish: _answer removes it
                    self.in_flight[self.forwarder.submit(job)] = held
                    self.in_flight_gauge.set(len(self.in_flight))
            except InvalidRequestError as error:
                self._send_error(sender, ErrorKind.INVALID, str(error))
            except Exception as error:  # overloaded front end, or a bug: this request fails alone
                self._send_error(sender, getattr(error, "kind", ErrorKind.INTERNAL), str(error))
        return None

    def _answer(self, job, answer, error):
        """Runs on the forwarder's thread once the engine answered every prompt of the request."""
        held = job.context
        with self.lock:
            self.in_flight.pop(job.job_id, None)
            self.in_flight_gauge.set(len(self.in_flight))
        with held.lock:  # from here on the watcher never asks this request is_cancelled()
            held.answered = True
        if error is not None:
            self._send_error(held.sender, error.kind, error.message)
            return
        tensors = [pb_utils.Tensor(name, value.astype(self.output_dtypes[name], copy=False))
                   for name, value in answer.items()]
        # `tensors` outlives send(): the 24.10 stub prunes unrequested outputs without holding the
        # GIL, so send() must never drop the last reference to a tensor.
        held.sender.send(pb_utils.InferenceResponse(output_tensors=tensors),
                         flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        del tensors

    @staticmethod
    def _send_error(sender, kind, message):
        code = getattr(pb_utils.TritonError, ErrorKind(kind).triton_code)
        sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(tagged(kind, message), code)),
                    flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def _watch_cancellations(self):
        cancelled = set()
        while not self.stopping.wait(CANCEL_POLL_SECONDS):
            if self.drain.deadline_passed() and self.in_flight:
                self.forwarder.fail_all(ForwardError(ErrorKind.OVERLOADED, tagged(
                    ErrorKind.OVERLOADED, "the server is restarting or shutting down; retry")))
            with self.lock:
                held_requests = list(self.in_flight.items())
            cancelled &= {job_id for job_id, _ in held_requests}
            for job_id, held in held_requests:
                if job_id in cancelled:
                    continue
                with held.lock:  # is_cancelled() only while no final response was sent
                    gone = not held.answered and held.request.is_cancelled()
                if gone:
                    cancelled.add(job_id)
                    self.forwarder.cancel(job_id)

    def finalize(self):
        self.stopping.set()
        self.watcher.join(5)
        self.forwarder.close()
