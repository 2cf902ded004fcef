"""Reliability promises, each against the real server: error codes on every transport, parameters
honoured or refused, batches answered whole, cancellation only by the request's own client, the
admin APIs behind a key, and the front end under sustained concurrent load with every policy."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from kvpop.policies import POLICIES
from kvpop_client import KVpopServerError
from loadtest.stress import run_stress

pytestmark = pytest.mark.server


def post(url: str, body: dict, headers: dict | None = None) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"{}")


def infer_json(server, inputs: list[dict], parameters: dict | None = None) -> tuple[int, dict]:
    body = {"inputs": inputs, **({"parameters": parameters} if parameters else {})}
    return post(f"http://{server.http_url}/v2/models/kvpop_service/infer", body)


TEXT = {"name": "text_input", "datatype": "BYTES", "shape": [1, 1], "data": ["Let a = 7. What is a?"]}


def output(body: dict, name: str):
    return next(item["data"] for item in body["outputs"] if item["name"] == name)


# -- the design guide's request, as written ------------------------------------------------------
def test_the_design_guides_request_works_as_written(triton_server):
    status, body = infer_json(triton_server, [
        {"name": "input_ids", "datatype": "INT32", "shape": [1, 4], "data": [1, 17, 45, 99]},
        {"name": "max_tokens", "datatype": "INT32", "shape": [1, 1], "data": [8]},
    ], parameters={"confidence_threshold": 0.9})  # unknown parameters are ignored
    assert status == 200, body
    assert output(body, "num_output_tokens") == [8]


# -- every parameter is honoured or refused -----------------------------------------------------
def test_decimal_parameters_are_honoured(triton_server):
    def answer(parameters):
        status, body = infer_json(triton_server, [TEXT], {"max_tokens": 24, **parameters})
        assert status == 200, body
        return body

    greedy = output(answer({}), "output_ids")
    sampled = [output(answer({"temperature": 1.5, "seed": seed}), "output_ids") for seed in (1, 2, 3)]
    assert any(ids != greedy for ids in sampled)  # 1.5 reached the sampler (it used to be dropped)
    compressed = answer({"eviction_policy": "streaming", "compression_ratio": 0.5})
    assert output(compressed, "kv_budget") == [int(np.ceil(0.5 * (output(compressed, "num_input_tokens")[0] + 24)))]


@pytest.mark.parametrize("parameters, message", [
    ({"kv_budget": 1.5, "eviction_policy": "h2o"}, "kv_budget"),
    ({"temperature": "hot"}, "temperature"),
    ({"max_tokens": 10**12}, "max_tokens"),
    ({"stream": True}, "kvpop_engine"),
    ({"stop": [1, 2]}, "stop"),
])
def test_bad_parameters_are_refused_with_400(triton_server, parameters, message):
    status, body = infer_json(triton_server, [TEXT], parameters)
    assert status == 400 and message in body["error"], body


def test_infinite_temperature_is_refused_on_every_transport(kvpop_http, kvpop_grpc):
    for client, status in ((kvpop_http, "400"), (kvpop_grpc, "StatusCode.INVALID_ARGUMENT")):
        with pytest.raises(KVpopServerError, match="temperature") as raised:
            client.generate("Let a = 7.", max_tokens=4, temperature=float("inf"))
        assert raised.value.status == status


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_streamed_errors_carry_their_kind(kvpop_http, kvpop_grpc, protocol):
    client = kvpop_http if protocol == "http" else kvpop_grpc
    with pytest.raises(KVpopServerError, match="max_tokens") as raised:
        list(client.stream("Let a = 7.", max_tokens=-1))
    assert raised.value.status == "INVALID_ARGUMENT"  # Triton's stream carries no code: the tag does


# -- a batch of N prompts gets N answers --------------------------------------------------------
@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_a_batch_of_prompts_gets_one_answer_each(triton_server, kvpop_http, protocol):
    module = httpclient if protocol == "http" else grpcclient
    url = triton_server.http_url if protocol == "http" else triton_server.grpc_url
    prompts = [b"Let a = 7. What is a?", b"Let b = 2.", b"Let c = 5. Let d = c."]
    text = module.InferInput("text_input", [3, 1], "BYTES")
    text.set_data_from_numpy(np.array([[prompt] for prompt in prompts], dtype=np.object_))
    limits = module.InferInput("max_tokens", [3, 1], "INT32")
    limits.set_data_from_numpy(np.array([[4], [6], [5]], dtype=np.int32))
    with module.InferenceServerClient(url) as client:
        result = client.infer("kvpop_service", [text, limits])
    counts = result.as_numpy("num_output_tokens").reshape(-1).tolist()
    ids = result.as_numpy("output_ids")
    assert ids.shape == (3, max(counts))
    for index, prompt in enumerate(prompts):
        alone = kvpop_http.generate(prompt.decode(), max_tokens=[4, 6, 5][index])
        assert ids[index, :counts[index]].tolist() == alone.output_ids  # padded with -1 past its end
        assert (ids[index, counts[index]:] == -1).all()


# -- only the request's own client can cancel it ------------------------------------------------
def test_no_client_can_cancel_another_clients_request(triton_server):
    """The victim streams with a known request id; another client forges the cancel control message
    the engine used to honour (`kvpop_cancel: <request id>`) and variants of it. The victim finishes."""
    import queue

    responses: queue.Queue = queue.Queue()
    ids = grpcclient.InferInput("input_ids", [1, 40], "INT32")
    ids.set_data_from_numpy(np.arange(5, 45, dtype=np.int32).reshape(1, -1))
    options = []
    for name, value, datatype, dtype in (("max_tokens", 1500, "INT32", np.int32), ("ignore_eos", True, "BOOL", bool),
                                         ("stream", True, "BOOL", bool)):
        options.append(grpcclient.InferInput(name, [1, 1], datatype))
        options[-1].set_data_from_numpy(np.array([[value]], dtype=dtype))
    with grpcclient.InferenceServerClient(triton_server.grpc_url) as victim:
        victim.start_stream(callback=lambda result, error: responses.put((result, error)))
        victim.async_stream_infer("kvpop_engine", [ids, *options], request_id="victim-request")
        assert responses.get(timeout=60)[1] is None  # it is running
        for forged in ({"kvpop_cancel": "victim-request"}, {"cancel": True, "request_id": "victim-request"}):
            for target in ("kvpop_engine", "kvpop_service"):
                post(f"http://{triton_server.http_url}/v2/models/{target}/generate",
                     {"text_input": "x", "max_tokens": 1, **forged})
        finish = None
        while finish is None:
            result, error = responses.get(timeout=120)
            assert error is None, error
            reason = result.as_numpy("finish_reason").reshape(-1)[0]
            finish = (reason.decode() or None, int(result.as_numpy("num_output_tokens").reshape(-1)[0])) if reason else None
        victim.stop_stream()
    assert finish == ("length", 1500)


# -- the admin APIs need the operator's key -----------------------------------------------------
@pytest.mark.parametrize("path, body", [
    ("/v2/logging", {"log_verbose_level": 1}),
    ("/v2/trace/setting", {"trace_level": ["TIMESTAMPS"]}),
    ("/v2/systemsharedmemory/region/leak/register", {"key": "triton_python_backend_shm_region_x", "offset": 0,
                                                     "byte_size": 64}),
    ("/v2/repository/index", {}),
])
def test_admin_apis_need_the_key(triton_server, path, body):
    url = f"http://{triton_server.http_url}{path}"
    status, _ = post(url, body)
    assert status == 403
    status, _ = post(url, body, headers={"kvpop-admin-key": "wrong"})
    assert status == 403
    if path == "/v2/repository/index":
        status, _ = post(url, body, headers={"kvpop-admin-key": triton_server.admin_key})
        assert status == 200


def test_statistics_need_the_key_over_grpc_too(triton_server):
    with grpcclient.InferenceServerClient(triton_server.grpc_url) as client:
        with pytest.raises(grpcclient.InferenceServerException):
            client.get_inference_statistics("kvpop_service")
        # Triton 2.51 prefixes the gRPC header: triton-grpc-protocol-<key>.
        headers = {"triton-grpc-protocol-kvpop-admin-key": triton_server.admin_key}
        statistics = client.get_inference_statistics("kvpop_service", headers=headers)
        assert statistics.model_stats


# -- the front end under sustained concurrent load, every policy --------------------------------
@pytest.mark.parametrize("policy", list(POLICIES))
def test_front_end_survives_sustained_load(triton_server, policy):
    bounded = {} if policy == "full" else {"compression_ratio": 0.5}
    for protocol, concurrency in (("http", 8), ("grpc", 32)):
        url = triton_server.http_url if protocol == "http" else triton_server.grpc_url
        summary = run_stress(url, requests=48, concurrency=concurrency, protocol=protocol, policy=policy,
                             max_tokens=12, timeout=120, log_file=triton_server.log_file, progress_every=0,
                             prompts=["Let a = 7. What is a? " * 6, "Let b = 3."], **bounded)
        # Overload rejections (503) are allowed at concurrency 32 with a 2-deep queue; nothing is lost.
        assert summary.ok, summary
        assert summary.completed + sum(summary.rejected.values()) == 48
        assert summary.completed >= 8
