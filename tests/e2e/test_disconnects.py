"""Clients that leave before their first token, on every route: while their request waits for KV memory,
and while its prompt is prefilled. Each is cancelled at once (dropped from the queue before it is
admitted; its prefill stopped and its KV released), and requests running beside it are unaffected. Also
what the sequence gauges count under load.

A server of its own prefills one prompt token per step, so that a long prompt's prefill lasts seconds,
and has a KV pool that holds one long prompt (and a short stream), not two.
"""

from __future__ import annotations

import http.client
import json
import time

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from kvpop.serving.process.tritonserver import TritonServer, free_port
from export.repository import assemble_model_repository
from tests.e2e.conftest import TEST_ENGINE_PARAMETERS, metric_reader, start_api

pytestmark = pytest.mark.server

SLOW_PREFILL = {**TEST_ENGINE_PARAMETERS, "prefill_chunk_tokens": "1", "min_prefill_chunk_tokens": "1",
                "max_prompt_tokens": "4000", "kv_pool_mb": "4", "max_running_sequences": "4", "max_queue_size": "8"}
# One such prompt and a short stream fit the 4 MiB pool (8192 slots of the tiny model; a batch pads every row
# to its longest), two do not: the second waits for KV memory.
LONG_PROMPT_TOKENS = 3500
ROUTES = ("openai stream", "openai complete", "engine gRPC stream", "service gRPC infer")


@pytest.fixture(scope="module")
def slow_server(tmp_path_factory, tiny_onnx_model_dir):
    root = assemble_model_repository(tmp_path_factory.mktemp("slow_prefill"), tiny_onnx_model_dir, SLOW_PREFILL)
    server = TritonServer(model_repository=root, http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(),
                          address="127.0.0.1", model_config_name="cpu",
                          log_file=tmp_path_factory.mktemp("slow_logs") / "tritonserver.log")
    with server:
        process, url = start_api(server, {"KVPOP_OPENAI_API_KEY": ""})
        try:
            yield server, url
        finally:
            process.terminate()
            process.wait(40)  # uvicorn gives open connections up to 30 s


@pytest.fixture(scope="module")
def long_prompt(tiny_onnx_model_dir) -> str:
    """Text of LONG_PROMPT_TOKENS tokens or a few fewer."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_onnx_model_dir / "tokenizer")
    ids = tokenizer(" ".join(f"fact {index} is {index * 7}." for index in range(1000))).input_ids[:LONG_PROMPT_TOKENS]
    text = tokenizer.decode(ids)
    assert LONG_PROMPT_TOKENS - 10 <= len(tokenizer(text).input_ids) <= LONG_PROMPT_TOKENS
    return text


def tensor(name: str, array: np.ndarray) -> grpcclient.InferInput:
    datatype = {np.object_: "BYTES", np.int32: "INT32", np.bool_: "BOOL"}[array.dtype.type]
    value = grpcclient.InferInput(name, list(array.shape), datatype)
    value.set_data_from_numpy(array)
    return value


def engine_inputs(prompt: str, max_tokens: int, **options) -> list[grpcclient.InferInput]:
    inputs = [tensor("text_input", np.array([[prompt.encode()]], dtype=np.object_)),
              tensor("max_tokens", np.array([[max_tokens]], dtype=np.int32))]
    for name, value in options.items():
        dtype = np.object_ if isinstance(value, str) else np.bool_ if isinstance(value, bool) else np.int32
        inputs.append(tensor(name, np.array([[value.encode() if isinstance(value, str) else value]], dtype=dtype)))
    return inputs


class Client:
    """One request on one route, sent and then abandoned (`leave`) before its answer."""

    def __init__(self, route: str, server: TritonServer, api: str, prompt: str, max_tokens: int = 8, **options) -> None:
        self.route, self.responses = route, []
        if route.startswith("openai"):
            body = {"model": "kvpop_engine", "prompt": prompt, "max_tokens": max_tokens, "stream": route == "openai stream",
                    **options}
            host, port = api.removeprefix("http://").split(":")
            self.connection = http.client.HTTPConnection(host, int(port), timeout=60)
            self.connection.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
            return
        self.client = grpcclient.InferenceServerClient(server.grpc_url)
        inputs = engine_inputs(prompt, max_tokens, **options)
        parameters = {"raw_prompt": True}  # as /v1/completions sends it
        if route == "engine gRPC stream":
            self.client.start_stream(callback=lambda result, error: self.responses.append((result, error)))
            self.client.async_stream_infer("kvpop_engine", inputs + [tensor("stream", np.array([[True]]))],
                                           parameters=parameters)
        else:
            self.call = self.client.async_infer("kvpop_service", inputs, parameters=parameters,
                                                callback=lambda result, error: self.responses.append((result, error)))

    def leave(self) -> None:
        if self.route.startswith("openai"):
            self.connection.close()
        elif self.route == "engine gRPC stream":
            self.client.stop_stream(cancel_requests=True)
            self.client.close()
        else:
            self.call.cancel()
            self.client.close()


def wait_for(condition, timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("route", ROUTES)
def test_a_client_that_leaves_before_its_first_token_is_cancelled_at_once(slow_server, long_prompt, route):
    server, api = slow_server
    read = metric_reader(server.metrics_url)
    beside = Client("engine gRPC stream", server, api, "a = 7 ; b = a ; b =", max_tokens=60_000,
                    eviction_policy="streaming", kv_budget=64, ignore_eos=True)
    try:
        assert wait_for(lambda: len(beside.responses) > 2)
        cancelled, first_tokens = read("kvpop_requests_total", finish_reason="cancelled"), read(
            "kvpop_time_to_first_token_seconds_count")
        prefilling = Client(route, server, api, long_prompt)
        assert wait_for(lambda: read("kvpop_prefilling_sequences") == 1)
        queued = Client(route, server, api, long_prompt)
        assert wait_for(lambda: read("kvpop_queued_sequences") == 1)  # no room for its prompt beside the first
        queued.leave()
        assert wait_for(lambda: read("kvpop_queued_sequences") == 0)
        assert read("kvpop_requests_total", finish_reason="cancelled") == cancelled + 1  # dropped, never admitted
        assert read("kvpop_prefilling_sequences") == 1  # the other one prefills on
        prefilling.leave()
        assert wait_for(lambda: read("kvpop_prefilling_sequences") == 0)
        assert wait_for(lambda: read("kvpop_requests_total", finish_reason="cancelled") == cancelled + 2)
        assert read("kvpop_time_to_first_token_seconds_count") == first_tokens  # neither got a first token
        assert wait_for(lambda: read("kvpop_kv_bytes_in_use") == read("kvpop_kv_bytes_reserved") == 64 * 512)
        streamed = len(beside.responses)
        assert wait_for(lambda: len(beside.responses) > streamed + 5)  # the stream beside them goes on
        assert all(error is None for _, error in beside.responses)
    finally:
        beside.leave()
    assert wait_for(lambda: read("kvpop_active_sequences") == read("kvpop_kv_bytes_reserved") == 0)


def steady_sequence_gauges(read) -> dict[str, float]:
    """The four sequence gauges, from two scrapes in a row that agree: the engine sets them one after
    another, so a scrape in between sees a sequence that has moved in one gauge and not yet in the next."""
    previous = None
    while True:
        samples = read()
        gauges = {name: sum(value for key, value in samples.items() if key.split("{")[0] == name)
                  for name in ("kvpop_active_sequences", "kvpop_prefilling_sequences", "kvpop_decoding_sequences",
                               "kvpop_queued_sequences")}
        if gauges == previous:
            return gauges
        previous = gauges


def test_the_sequence_gauges_say_what_they_count_under_load(slow_server):
    """Seven streams with room for four in the running batch (max_running_sequences): kvpop_active_sequences
    never counts more than four, prefilling + decoding make it, and the rest are counted as queued."""
    server, api = slow_server
    read = metric_reader(server.metrics_url)
    streams = [Client("engine gRPC stream", server, api, f"stream {index}: a = 7 ;", max_tokens=60_000,
                      eviction_policy="streaming", kv_budget=64, ignore_eos=True) for index in range(7)]
    try:
        assert wait_for(lambda: read("kvpop_queued_sequences") == 3 and read("kvpop_active_sequences") == 4)
        for _ in range(20):
            gauges = steady_sequence_gauges(read)
            assert gauges["kvpop_active_sequences"] <= 4, gauges
            assert gauges["kvpop_active_sequences"] == gauges["kvpop_prefilling_sequences"] + gauges["kvpop_decoding_sequences"]
            assert gauges["kvpop_active_sequences"] + gauges["kvpop_queued_sequences"] == 7, gauges
            time.sleep(0.05)
    finally:
        for stream in streams:
            stream.leave()
    assert wait_for(lambda: read("kvpop_active_sequences") == read("kvpop_queued_sequences") == 0)
