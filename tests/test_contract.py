"""The I/O contract (kvpop.serving.contract) against everything that restates it: every config.pbtxt,
the client's mirror, the worker's output tensors and the error kinds."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from kvpop.serving import contract
from kvpop.serving.contract import ErrorKind

REPOSITORY = Path(__file__).resolve().parents[1] / "model_repository"
CONFIGS = sorted([*REPOSITORY.glob("*/config.pbtxt"), *REPOSITORY.glob("*/configs/*.pbtxt")])


def parse(path: Path) -> model_config_pb2.ModelConfig:
    return text_format.Parse(path.read_text(), model_config_pb2.ModelConfig())


def declared(tensor) -> tuple:
    return (tensor.name, model_config_pb2.DataType.Name(tensor.data_type), tuple(tensor.dims))


def test_every_model_variant_is_checked():
    names = {path.relative_to(REPOSITORY).as_posix() for path in CONFIGS}
    assert {"kvpop_engine/config.pbtxt", "kvpop_engine/configs/cpu.pbtxt", "kvpop_service/config.pbtxt"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda path: path.relative_to(REPOSITORY).as_posix())
def test_config_declares_the_contract(path):
    config = parse(path)
    model = contract.MODELS[path.parent.name if path.parent.name != "configs" else path.parent.parent.name]
    assert config.name == model.name
    assert config.model_transaction_policy.decoupled == model.decoupled
    inputs = {tensor.name: tensor for tensor in config.input}
    assert sorted(inputs) == sorted(spec.name for spec in model.inputs)
    for spec in model.inputs:
        tensor = inputs[spec.name]
        assert declared(tensor) == (spec.name, spec.data_type, spec.dims)
        assert (tensor.optional, tensor.allow_ragged_batch) == (spec.optional, spec.ragged), spec.name
    assert [declared(tensor) for tensor in config.output] == [
        (spec.name, spec.data_type, spec.dims) for spec in model.outputs]

def test_the_service_takes_every_engine_input_but_stream():
    assert {spec.name for spec in contract.ENGINE.inputs} - {spec.name for spec in contract.SERVICE.inputs} == {"stream"}
    assert contract.SERVICE.outputs == contract.ENGINE.outputs


def test_the_client_mirror_equals_the_contract():
    from kvpop_client import contract as mirror

    assert mirror.PROMPT_INPUTS == {spec.name: spec.datatype for spec in contract.PROMPT_INPUTS}
    assert mirror.OPTION_INPUTS == {spec.name: spec.datatype for spec in contract.OPTION_INPUTS}
    assert mirror.LIST_INPUTS == {spec.name: spec.datatype for spec in contract.LIST_INPUTS}
    assert set(mirror.PROMPT_INPUTS) | set(mirror.OPTION_INPUTS) | set(mirror.LIST_INPUTS) == {
        spec.name for spec in contract.ENGINE.inputs}
    assert mirror.OUTPUTS == {spec.name: spec.datatype for spec in contract.OUTPUTS}
    assert {name: np.dtype(dtype) for name, dtype in mirror.NUMPY_DTYPES.items()} == {
        wire: np.dtype(dtype) for wire, dtype, _ in contract.DATA_TYPES.values()}
    assert mirror.FINISH_REASONS == contract.FINISH_REASONS
    assert mirror.ERROR_TAG_STATUS == {kind.tag: kind.grpc_status for kind in ErrorKind}


def test_error_kinds_map_to_each_transport():
    assert [(kind.http_status, kind.grpc_status, kind.triton_code) for kind in ErrorKind] == [
        (400, "INVALID_ARGUMENT", "INVALID_ARG"), (503, "UNAVAILABLE", "UNAVAILABLE"), (500, "INTERNAL", "INTERNAL")]
    assert ErrorKind("invalid") is ErrorKind.INVALID and f"{ErrorKind.OVERLOADED}" == "overloaded"


@pytest.mark.parametrize("finish_reason", [None, "length"])
def test_worker_outputs_follow_the_contract(finish_reason):
    from kvpop.serving.kvpop_engine.responses import output_tensors

    tensors = output_tensors("hi", [7], finish_reason, 3, 1)
    expected = [spec for spec in contract.OUTPUTS if spec.streamed or finish_reason is not None]
    assert list(tensors) == [spec.name for spec in expected]
    for spec in expected:
        assert tensors[spec.name].dtype == np.dtype(spec.numpy_dtype), spec.name
        assert tensors[spec.name].shape == (1, 1), spec.name  # batch of 1, one value (output_ids: one token)


def test_request_parser_reads_every_option_input():
    from kvpop.serving.kvpop_engine.parse import SCALAR_INPUTS, UNSET_WHEN_ZERO

    assert SCALAR_INPUTS == {spec.name: spec.python_type for spec in contract.OPTION_INPUTS}
    assert set(UNSET_WHEN_ZERO) <= set(SCALAR_INPUTS)


@pytest.mark.parametrize("name, value, expected", [
    ("max_tokens", 5, 5), ("max_tokens", 5.0, 5), ("max_tokens", 2**31 - 1, 2**31 - 1), ("temperature", 1, 1.0),
    ("seed", 2**64 - 1, 2**64 - 1), ("eviction_policy", "kvpop", "kvpop"), ("ignore_eos", True, True),
])
def test_a_value_its_wire_type_carries_passes(name, value, expected):
    checked = contract.SCALAR_INPUTS[name].check(value)
    assert checked == expected and type(checked) is type(expected)


@pytest.mark.parametrize("name, value, message", [
    ("max_tokens", 2**31, "out of range for INT32"), ("max_tokens", -(2**31) - 1, "out of range for INT32"),
    ("max_tokens", 2**63, "out of range"), ("max_tokens", True, "must be a number"), ("max_tokens", 2.5, "integer"),
    ("max_tokens", float("inf"), "integer"), ("max_tokens", "5", "must be a number"), ("seed", -1, "out of range for UINT64"),
    ("seed", 2**64, "out of range"), ("temperature", float("nan"), "finite"), ("temperature", 1e39, "out of range for FP32"),
    ("temperature", False, "must be a number"), ("eviction_policy", "\ud800", "UTF-8"), ("eviction_policy", 5, "UTF-8"),
    ("ignore_eos", 1, "boolean"),
])
def test_a_value_its_wire_type_cannot_carry_names_the_input(name, value, message):
    with pytest.raises(ValueError, match=f"{name}.*{message}|{message}.*{name}"):
        contract.SCALAR_INPUTS[name].check(value)


def test_unencodable_text_is_found_wherever_it_is():
    assert contract.unencodable_at({"a": [1, "ok", {"b": "x\ud800"}]}) == "a.2.b"
    assert contract.unencodable_at({"k\udc00": 1}) == "k\\udc00"
    assert contract.unencodable_at("\ud800") == ""
    assert contract.unencodable_at({"": ["\ud800"]}) == ".0"  # an empty key is a field, not the root
    assert contract.unencodable_at({"a": ["fine", "漢字 🙂"]}) is None


def test_the_engine_stream_client_types_its_inputs_by_the_contract():
    """The forwarder and the OpenAI API reach the engine through one client (kvpop.serving.engine_stream), whose
    tensors take their datatypes from the contract."""
    from kvpop.openai_api.engine_client import OUTPUTS, EngineRequest
    from kvpop.serving.engine_stream import engine_inputs

    tensors = engine_inputs({"text_input": "hi", "max_tokens": 3, "seed": 7, "top_p": 0.5, "stop": ["a", "bb"], "stream": True})
    for name, array in tensors.items():
        assert array.dtype == contract.ENGINE.input(name).numpy_dtype and array.shape[0] == 1, name
    assert tensors["stop"].tolist() == [[b"a", b"bb"]]
    chat = EngineRequest(messages=[{"role": "user", "content": "hi"}], max_tokens=4, kv_budget=64).tensors()
    assert all(array.dtype == contract.ENGINE.input(name).numpy_dtype for name, array in chat.items())
    assert set(OUTPUTS) <= {spec.name for spec in contract.ENGINE.outputs}
