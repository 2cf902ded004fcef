"""Triton Python-backend adapter for KVpop: lifecycle and Triton types only.

Parsing, generation and response building live in `kvpop.serving`; see that package.
"""

import json
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from kvpop.serving.config import ServiceConfig
from kvpop.serving.request import InvalidRequestError, parse_parameters
from kvpop.serving.service import KVpopService, Placement


class TritonPythonModel:
    def initialize(self, args):
        model_config = json.loads(args["model_config"])
        version_dir = Path(args["model_repository"]) / args["model_version"]
        try:
            config = ServiceConfig.from_model_config(model_config)
        except ValueError as error:
            raise pb_utils.TritonModelException(f"kvpop_service config.pbtxt: {error}") from None
        if not (version_dir / "model_spec.json").exists():
            raise pb_utils.TritonModelException(f"no exported model in {version_dir}: run `make export`")
        self.service = KVpopService(version_dir, config, Placement.from_triton_args(args))
        self.output_dtypes = {
            output["name"]: pb_utils.triton_string_to_numpy(output["data_type"]) for output in model_config["output"]
        }

    def execute(self, requests):
        parsed, responses = {}, [None] * len(requests)
        for index, request in enumerate(requests):
            try:
                parsed[index] = self.service.parse(
                    request.request_id() or f"request-{index}",
                    lambda name, request=request: _input_array(request, name),
                    parse_parameters(request.parameters()),
                )
            except InvalidRequestError as error:
                responses[index] = _error_response(str(error), pb_utils.TritonError.INVALID_ARG)
        if parsed:
            try:
                results = self.service.generate(list(parsed.values()))
            except Exception as error:  # an engine failure fails this batch, not the server
                results = None
                message = f"generation failed: {type(error).__name__}: {error}"
            for position, index in enumerate(parsed):
                if results is None:
                    responses[index] = _error_response(message, pb_utils.TritonError.INTERNAL)
                    continue
                tensors = self.service.response_tensors(results[position])
                responses[index] = pb_utils.InferenceResponse(
                    output_tensors=[
                        pb_utils.Tensor(name, value.astype(self.output_dtypes[name], copy=False))
                        for name, value in tensors.items()
                        if name in self.output_dtypes
                    ]
                )
        return responses

    def finalize(self):
        self.service = None


def _input_array(request, name):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return None
    array = tensor.as_numpy()
    # Inputs carry Triton's batch dimension of 1 (max_batch_size > 0); drop it.
    return array[0] if array.ndim > 1 and array.shape[0] == 1 else np.asarray(array).reshape(-1)


def _error_response(message, code):
    return pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(message, code))
