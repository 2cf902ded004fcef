"""The OpenAI-compatible API against the real server, through the official `openai` SDK (sync and async),
raw SSE, and the TensorRT-LLM-format tensors Triton's own OpenAI frontend sends to kvpop_engine."""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import subprocess
import sys
import time
import urllib.request

import numpy as np
import openai
import pytest

from kvpop.serving.process import free_port

pytestmark = pytest.mark.server

MODEL = "kvpop_engine"
API_KEY = "e2e-openai-key"
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Let a = 7. What is a?"}]
LONG_PROMPT = " ".join(f"Fact {index}: the value of x{index} is {index * 7}." for index in range(12))


def start_api(triton_server, env: dict[str, str] | None = None):
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "kvpop.openai_api", "--port", str(port), "--triton-grpc", triton_server.grpc_url],
        env={**os.environ, **(env or {})}, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as response:
                if response.status == 200:
                    return process, url
        except OSError:
            time.sleep(0.2)
    process.kill()
    raise AssertionError("the OpenAI API did not become healthy")


@pytest.fixture(scope="module")
def api(triton_server):
    process, url = start_api(triton_server, {"KVPOP_OPENAI_API_KEY": ""})
    yield url
    process.terminate()
    process.wait(10)


@pytest.fixture(scope="module")
def client(api):
    return openai.OpenAI(base_url=api + "/v1", api_key="unused", max_retries=0)


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


def test_async_client(api):
    async def run():
        async with openai.AsyncOpenAI(base_url=api + "/v1", api_key="unused", max_retries=0) as aclient:
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


def test_a_client_that_disconnects_mid_stream_frees_its_slots(api, metrics):
    cancelled = metrics("kvpop_requests_total", finish_reason="cancelled")
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4000, "stream": True, "ignore_eos": True,
            "eviction_policy": "streaming", "kv_budget": 64}
    host, port = api.removeprefix("http://").split(":")
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


def test_a_client_that_stops_waiting_for_a_complete_answer_frees_its_slots(api, metrics):
    cancelled = metrics("kvpop_requests_total", finish_reason="cancelled")
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4000, "ignore_eos": True,
            "eviction_policy": "streaming", "kv_budget": 64}
    host, port = api.removeprefix("http://").split(":")
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
