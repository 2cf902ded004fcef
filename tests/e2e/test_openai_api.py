"""The OpenAI-compatible API against the real server, through the official `openai` SDK (sync and async),
raw SSE, and the TensorRT-LLM-format tensors Triton's own OpenAI frontend sends to kvpop_engine."""

from __future__ import annotations

import asyncio
import http.client
import json
import re
import time
import urllib.request

import numpy as np
import openai
import pytest

from tests.e2e.conftest import start_api

pytestmark = pytest.mark.server

MODEL = "kvpop_engine"
API_KEY = "e2e-openai-key"
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Let a = 7. What is a?"}]
LONG_PROMPT = " ".join(f"Fact {index}: the value of x{index} is {index * 7}." for index in range(12))


@pytest.fixture(scope="module")
def client(openai_api):
    return openai.OpenAI(base_url=openai_api + "/v1", api_key="unused", max_retries=0)


def test_models_lists_the_engine(client):
    assert [model.id for model in client.models.list().data] == [MODEL]


def test_chat_completion_answers_with_usage(client):
    completion = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0)
    choice = completion.choices[0]
    assert completion.object == "chat.completion" and choice.message.role == "assistant"
    assert isinstance(choice.message.content, str) and choice.finish_reason in ("stop", "length")
    assert completion.usage.prompt_tokens > 0 and 1 <= completion.usage.completion_tokens <= 8
    assert completion.usage.total_tokens == completion.usage.prompt_tokens + completion.usage.completion_tokens


def test_streamed_chat_equals_the_complete_answer(client):
    complete = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0,
                                              extra_body={"ignore_eos": True})
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert text == complete.choices[0].message.content
    finals = [chunk for chunk in chunks if chunk.choices and chunk.choices[0].finish_reason]
    assert [chunk.choices[0].finish_reason for chunk in finals] == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == complete.usage.prompt_tokens


def test_kvpop_controls_report_a_bounded_cache(client):
    messages = [{"role": "user", "content": LONG_PROMPT + " What is x3?"}]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0,
                                          extra_body={"eviction_policy": "full"})
    bounded = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0,
                                             extra_body={"eviction_policy": "kvpop", "compression_ratio": 0.88})
    statistics = bounded.model_extra["kvpop"]
    assert full.model_extra["kvpop"]["tokens_evicted"] == 0
    assert 0 < statistics["kv_budget"] < bounded.usage.prompt_tokens
    assert statistics["tokens_evicted"] > 0 and statistics["compression"] > 0.5
    assert statistics["peak_kv_bytes"] < full.model_extra["kvpop"]["peak_kv_bytes"]


def test_completions_stream_and_not(client):
    complete = client.completions.create(model=MODEL, prompt="a = 7 ; b = a ; b =", max_tokens=6, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert complete.object == "text_completion" and complete.usage.completion_tokens == 6
    streamed = "".join(chunk.choices[0].text for chunk in client.completions.create(
        model=MODEL, prompt="a = 7 ; b = a ; b =", max_tokens=6, temperature=0, stream=True,
        extra_body={"ignore_eos": True}) if chunk.choices)
    assert streamed == complete.choices[0].text


def test_async_client(openai_api):
    async def run():
        async with openai.AsyncOpenAI(base_url=openai_api + "/v1", api_key="unused", max_retries=0) as aclient:
            answers = await asyncio.gather(*(aclient.chat.completions.create(
                model=MODEL, messages=MESSAGES, max_tokens=5, temperature=0) for _ in range(3)))
            stream = await aclient.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5,
                                                           temperature=0, stream=True)
            streamed = "".join([chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices])
            return answers, streamed

    answers, streamed = asyncio.run(run())
    assert len({answer.choices[0].message.content for answer in answers}) == 1
    assert streamed == answers[0].choices[0].message.content


@pytest.mark.parametrize("arguments, param", [
    ({"n": 2}, "n"),
    ({"temperature": 5.0}, "temperature"),
    ({"extra_body": {"logprobs": True}}, "logprobs"),
    ({"extra_body": {"eviction_policy": "nonsense"}}, None),
    ({"extra_body": {"session_id": "../../etc/passwd"}}, None),
    ({"messages": []}, "messages"),
])
def test_client_mistakes_raise_bad_request(client, arguments, param):
    arguments = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4, **arguments}
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(**arguments)
    error = raised.value.body
    assert raised.value.status_code == 400 and error["type"] == "invalid_request_error" and error["message"]
    if param is not None:
        assert param in (error["param"] or "")


def test_unknown_model_is_not_found(client):
    with pytest.raises(openai.NotFoundError) as raised:
        client.chat.completions.create(model="gpt-4o", messages=MESSAGES)
    assert raised.value.body["code"] == "model_not_found"


def test_api_key_is_required_when_configured(triton_server):
    process, url = start_api(triton_server, {"KVPOP_OPENAI_API_KEY": API_KEY})
    try:
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
        keyed = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0)
        assert keyed.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2).choices
    finally:
        process.terminate()
        process.wait(10)


def wait_until_cancelled(metrics, cancelled_before: float, timeout: float = 30.0) -> None:
    """Until the engine counted one more cancelled request and runs no sequence (or the timeout)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (metrics("kvpop_requests_total", finish_reason="cancelled") > cancelled_before
                and metrics("kvpop_active_sequences") == 0):
            return
        time.sleep(0.2)


def test_a_client_that_disconnects_mid_stream_frees_its_slots(openai_api, metrics):
    cancelled = metrics("kvpop_requests_total", finish_reason="cancelled")
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4000, "stream": True, "ignore_eos": True,
            "eviction_policy": "streaming", "kv_budget": 64}
    host, port = openai_api.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    connection.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = connection.getresponse()
    assert response.status == 200, response.read()
    received = [response.readline() for _ in range(6)]
    assert any(line.startswith(b"data: {") for line in received)
    connection.close()  # the client goes away mid-stream
    wait_until_cancelled(metrics, cancelled)
    assert metrics("kvpop_requests_total", finish_reason="cancelled") == cancelled + 1
    assert metrics("kvpop_active_sequences") == 0


def test_a_client_that_stops_waiting_for_a_complete_answer_frees_its_slots(openai_api, metrics):
    cancelled = metrics("kvpop_requests_total", finish_reason="cancelled")
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4000, "ignore_eos": True,
            "eviction_policy": "streaming", "kv_budget": 64}
    host, port = openai_api.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    connection.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    deadline = time.monotonic() + 30
    while metrics("kvpop_active_sequences") == 0 and time.monotonic() < deadline:
        time.sleep(0.05)  # until the engine runs it
    connection.close()  # the client gives up before the answer is complete
    wait_until_cancelled(metrics, cancelled)
    assert metrics("kvpop_requests_total", finish_reason="cancelled") == cancelled + 1
    assert metrics("kvpop_active_sequences") == 0


@pytest.mark.parametrize("stream", [True, False])
def test_triton_openai_frontend_request_format(triton_server, stream):
    """Exactly the tensors Triton's OpenAI frontend builds for a Python-backend model (TensorRT-LLM format)."""
    import tritonclient.grpc as grpcclient

    tensors = {
        "text_input": np.array([[b"a = 7 ; b = a ; b ="]], dtype=np.object_),
        "stream": np.bool_([[stream]]),
        "max_tokens": np.int32([[5]]),
        "stop_words": np.array([[b"never-generated-stop"]], dtype=np.object_),
        "top_p": np.float32([[1.0]]),
        "frequency_penalty": np.float32([[0.0]]),
        "presence_penalty": np.float32([[0.0]]),
        "seed": np.uint64([[3]]),
        "temperature": np.float32([[0.0]]),
        "return_num_input_tokens": np.bool_([[True]]),
        "return_num_output_tokens": np.bool_([[True]]),
    }
    inputs = []
    for name, array in tensors.items():
        tensor = grpcclient.InferInput(name, list(array.shape), "BYTES" if array.dtype == object else
                                       {np.bool_: "BOOL", np.int32: "INT32", np.float32: "FP32",
                                        np.uint64: "UINT64"}[array.dtype.type])
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    results = []
    client = grpcclient.InferenceServerClient(triton_server.grpc_url)
    client.start_stream(callback=lambda result, error: results.append((result, error)))
    try:
        client.async_stream_infer(MODEL, inputs, enable_empty_final_response=False)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not any(
                error is not None or result.as_numpy("finish_reason").reshape(-1)[0] for result, error in results):
            time.sleep(0.05)
    finally:
        client.stop_stream()
        client.close()
    assert all(error is None for _, error in results), results
    texts = [result.as_numpy("text_output").reshape(-1)[0].decode() for result, _ in results]
    last = results[-1][0]
    generated = int(last.as_numpy("num_output_tokens").reshape(-1)[0])
    assert len(results) in ((generated, generated + 1) if stream else (1,))
    assert last.as_numpy("num_input_tokens").reshape(-1)[0] > 0
    assert 1 <= last.as_numpy("num_output_tokens").reshape(-1)[0] <= 5
    assert "".join(texts) or last.as_numpy("finish_reason").reshape(-1)[0] == b"stop"


def raw(openai_api: str, method: str, path: str, body: bytes | None = None, headers: dict | None = None):
    """(status, decoded JSON body) of one request sent as is."""
    host = openai_api.removeprefix("http://")
    connection = http.client.HTTPConnection(host, timeout=60)
    connection.request(method, path, body, {"Content-Type": "application/json", **(headers or {})})
    response = connection.getresponse()
    data = response.read()
    connection.close()
    return response.status, json.loads(data)


def assert_openai_error(status: int, answer: dict, expected_status: int, param: str | None = "any") -> dict:
    assert status == expected_status, answer
    error = answer["error"]
    assert set(answer) == {"error"} and set(error) == {"message", "type", "param", "code"}, answer
    assert error["message"] and error["type"] in ("invalid_request_error", "service_unavailable"), answer
    if param != "any":
        assert error["param"] == param, answer
    return error


CHAT = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2}
SURROGATE = "\ud800"


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"model": MODEL, "prompt": "a" + SURROGATE, "max_tokens": 2}, "prompt"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": SURROGATE}]}, "messages.0.content"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": SURROGATE}]}]},
     "messages.0.content.0.text"),
    ("/v1/chat/completions", {**CHAT, "stop": ["ok", SURROGATE]}, "stop.1"),
    ("/v1/chat/completions", {**CHAT, "session_id": "s" + SURROGATE}, "session_id"),
    ("/v1/chat/completions", {**CHAT, "eviction_policy": SURROGATE}, "eviction_policy"),
    ("/v1/chat/completions", {**CHAT, "user": SURROGATE}, "user"),
    ("/v1/chat/completions", {**CHAT, SURROGATE: 1}, "\\ud800"),
])
def test_a_lone_surrogate_in_any_string_is_a_400(openai_api, path, body, param):
    data = json.dumps(body).encode()  # json.dumps escapes the surrogate: "\ud800", as any client would send it
    assert b"\\ud800" in data
    assert_openai_error(*raw(openai_api, "POST", path, data), 400, param)


@pytest.mark.parametrize("field, value", [
    ("max_tokens", 2**63), ("max_tokens", 2**32 + 3), ("max_tokens", True), ("max_completion_tokens", 2**32 + 3),
    ("kv_budget", 2**32 + 100), ("kv_budget", 2**32 - 1), ("kv_budget", -5), ("kv_budget", True), ("seed", 2**64),
    ("temperature", True), ("compression_ratio", 1e39), ("top_p", False),
])
def test_an_integer_its_wire_type_cannot_carry_is_a_400_naming_the_field(openai_api, field, value):
    body = {**CHAT, "eviction_policy": "streaming", field: value}
    assert_openai_error(*raw(openai_api, "POST", "/v1/chat/completions", json.dumps(body).encode()), 400, field)


def test_kv_budget_zero_means_the_default_budget_as_on_every_route(openai_api, kvpop_http):
    body = {**CHAT, "eviction_policy": "streaming", "kv_budget": 0, "max_tokens": 1}
    status, answer = raw(openai_api, "POST", "/v1/chat/completions", json.dumps(body).encode())
    served = kvpop_http.chat(MESSAGES, max_tokens=1, eviction_policy="streaming", kv_budget=0)
    assert status == 200 and answer["kvpop"]["kv_budget"] == served.kv_budget == 128  # TEST_ENGINE_PARAMETERS


@pytest.mark.parametrize("method, path, body, status", [
    ("POST", "/v1/chat/completions", b"{\"model\": " + b"[" * 100_000 + b"]" * 100_000 + b"}", 400),
    ("POST", "/v1/chat/completions", b"{\"model\": \"kvpop_engine\", \"messages\": \"\xff\xfe\"}", 400),
    ("POST", "/v1/chat/completions", b"{\"model\": \"kvpop_engine\",", 400),
    ("POST", "/v1/chat/completions", b"[1, 2]", 400),
    ("GET", "/v1/chat/completions", None, 405),
    ("DELETE", "/v1/models", None, 405),
    ("POST", "/v1/no/such/route", b"{}", 404),
    ("GET", "/v1/", None, 404),
])
def test_every_error_has_openai_s_body(openai_api, method, path, body, status):
    error = assert_openai_error(*raw(openai_api, method, path, body), status)
    assert error["param"] is None or not error["param"].isdigit()  # never a byte offset


def test_a_body_over_the_limit_is_refused_before_it_reaches_triton(openai_api, triton_server, metrics):
    """413 with OpenAI's body, whether the client declares the size or streams the body in chunks."""
    before = metrics("nv_inference_request_success") + metrics("nv_inference_request_failure")
    big = json.dumps({**CHAT, "messages": [{"role": "user", "content": "x" * (5 * 2**20)}]}).encode()
    error = assert_openai_error(*raw(openai_api, "POST", "/v1/chat/completions", big), 413)
    assert error["code"] == "request_too_large"
    host, port = openai_api.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=60)
    connection.request("POST", "/v1/chat/completions", (big[i : i + 65536] for i in range(0, len(big), 65536)),
                       {"Content-Type": "application/json", "Transfer-Encoding": "chunked"}, encode_chunked=True)
    response = connection.getresponse()
    assert_openai_error(response.status, json.loads(response.read()), 413)
    connection.close()
    assert metrics("nv_inference_request_success") + metrics("nv_inference_request_failure") == before


def route_series(openai_api: str) -> set[tuple[str, str]]:
    with urllib.request.urlopen(openai_api + "/metrics", timeout=10) as response:
        text = response.read().decode()
    return set(re.findall(r'kvpop_openai_requests_total\{route="([^"]*)",status="(\d+)"\}', text))


def test_request_metrics_are_labelled_by_route_template(openai_api):
    """Any path a client makes up counts under one label: random paths make no new series."""
    raw(openai_api, "GET", "/v1/models/some-model")
    raw(openai_api, "GET", "/v1/no-such-path")
    before = route_series(openai_api)
    assert ("/v1/models/{model}", "404") in before and ("unknown", "404") in before
    for index in range(50):
        raw(openai_api, "GET", f"/v1/models/random-{index}")
        raw(openai_api, "POST", f"/v1/random/{index}/path", b"{}")
    after = route_series(openai_api)
    assert after == before and {route for route, _ in after} <= {
        "/v1/models", "/v1/models/{model}", "/v1/chat/completions", "/v1/completions", "unknown"}
