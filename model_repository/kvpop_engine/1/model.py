"""Triton Python-backend adapter for the KVpop engine: lifecycle and Triton types only.

Decoupled: `execute` parses and queues each request and returns at once; the engine worker thread
(kvpop.serving.kvpop_engine.worker) answers through each request's response sender, token by token when the
request asks to stream. Parsing and the engine thread live in `kvpop.serving.kvpop_engine`; admission and batching in the engine (`kvpop.engine`).
"""

import json
from pathlib import Path

import triton_python_backend_utils as pb_utils

from kvpop.engine.admission import OverloadedError
from kvpop.serving.contract import ErrorKind
from kvpop.serving.errors import InvalidRequestError, tagged
from kvpop.serving.kvpop_engine.config import ServiceConfig
from kvpop.serving.kvpop_engine.metrics import ServiceMetrics
from kvpop.serving.kvpop_engine.model import KVpopEngineModel, Placement
from kvpop.serving.kvpop_engine.parse import parse_parameters
from kvpop.serving.process.state_dir import model_state_dir
from kvpop.serving.process.stubs import exit_with_server


def error_code(kind):
    """Triton's error code for an error kind (pb_utils.TritonError exists only at run time)."""
    return getattr(pb_utils.TritonError, ErrorKind(kind).triton_code)


class TritonChannel:
    """A request's response sender, as the engine worker's ResponseChannel."""

    def __init__(self, request, output_dtypes):
        self.request = request  # kept alive for is_cancelled()
        self.sender = request.get_response_sender()
        self.output_dtypes = output_dtypes

    def send(self, tensors, final):
        outputs = [
            pb_utils.Tensor(name, value.astype(self.output_dtypes[name], copy=False)) for name, value in tensors.items()
        ]
        # `outputs` outlives send(): the 24.10 stub prunes unrequested outputs without holding the GIL,
        # so send() must never drop the last reference to a tensor.
        self.sender.send(pb_utils.InferenceResponse(output_tensors=outputs),
                         flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0)
        del outputs

    def send_error(self, message, kind):
        response = pb_utils.InferenceResponse(error=pb_utils.TritonError(tagged(kind, message), error_code(kind)))
        self.sender.send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def is_cancelled(self):
        return self.sender.is_cancelled()


class TritonPythonModel:
    def initialize(self, args):
        exit_with_server()  # a stub that lost its server mid-request would otherwise never exit
        model_config = json.loads(args["model_config"])
        version_dir = Path(args["model_repository"]) / args["model_version"]
        if not pb_utils.using_decoupled_model_transaction_policy(model_config):
            raise pb_utils.TritonModelException("kvpop_engine must be decoupled (model_transaction_policy)")
        try:
            config = ServiceConfig.from_model_config(model_config)
        except ValueError as error:
            raise pb_utils.TritonModelException(f"{args['model_name']} config.pbtxt: {error}") from None
        if not (version_dir / "model_spec.json").exists():
            raise pb_utils.TritonModelException(f"no exported model in {version_dir}: run `make export`")
        placement = Placement.from_triton_args(args)
        metrics = ServiceMetrics(
            pb_utils, args["model_name"], placement.label, config.kv_pool_bytes, KVpopEngineModel.policies()
        )
        try:
            self.service = KVpopEngineModel(version_dir, config, placement, metrics, model_state_dir(args["model_name"]))
        except ValueError as error:
            raise pb_utils.TritonModelException(f"{args['model_name']}: {error}") from None
        self.metrics = metrics
        self.output_dtypes = {
            output["name"]: pb_utils.triton_string_to_numpy(output["data_type"]) for output in model_config["output"]
        }

    def execute(self, requests):
        for request in requests:
            channel = TritonChannel(request, self.output_dtypes)
            try:
                parameters = parse_parameters(request.parameters())
                self.service.submit(
                    lambda name, request=request: _input_array(request, name),
                    parameters,
                    channel,
                    client_request_id=request.request_id() or "",
                )
            except InvalidRequestError as error:
                self.metrics.observe_rejected(ErrorKind.INVALID)
                channel.send_error(str(error), ErrorKind.INVALID)
            except OverloadedError as error:
                self.metrics.observe_rejected(ErrorKind.OVERLOADED)
                channel.send_error(str(error), ErrorKind.OVERLOADED)
            except Exception as error:  # a bug must fail this request only
                self.metrics.observe_rejected(ErrorKind.INTERNAL)
                channel.send_error(f"internal error: {type(error).__name__}: {error}", ErrorKind.INTERNAL)
        return None

    def finalize(self):
        self.service.shutdown()


def _input_array(request, name):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return None
    array = tensor.as_numpy()
    # Inputs carry Triton's batch dimension of 1 (max_batch_size > 0); drop it.
    return array[0] if array.ndim > 1 else array.reshape(-1)
