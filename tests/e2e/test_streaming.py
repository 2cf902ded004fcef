"""Streaming and the generate endpoints, served by the same engine as /infer."""

from __future__ import annotations

import json
import urllib.request

import pytest

pytestmark = pytest.mark.server
PROMPT = "Let a = 7. Let b = a + 5. What is b?"


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_stream_yields_the_tokens_of_the_complete_answer(kvpop_http, kvpop_grpc, protocol):
    client = kvpop_grpc if protocol == "grpc" else kvpop_http
    complete = kvpop_http.generate(PROMPT, max_tokens=12)
    chunks = list(client.stream(PROMPT, max_tokens=12))
    assert len(chunks) == 12  # one response per generated token
    assert [token for chunk in chunks for token in chunk.token_ids] == complete.output_ids
    result = chunks[-1].result
    assert result is not None and all(chunk.result is None for chunk in chunks[:-1])
    assert result.output_ids == complete.output_ids
    assert result.text == complete.text == "".join(chunk.text for chunk in chunks)
    assert result.finish_reason == "length" and result.num_output_tokens == 12


def test_grpc_stream_of_token_ids(kvpop_grpc):
    prompt = [5, 17, 45, 99, 120, 7, 33]
    streamed = [token for chunk in kvpop_grpc.stream(prompt, max_tokens=6) for token in chunk.token_ids]
    assert streamed == kvpop_grpc.generate(prompt, max_tokens=6).output_ids


@pytest.mark.parametrize("model", ["kvpop_service", "kvpop_engine"])
def test_generate_endpoint_returns_one_complete_answer(triton_server, kvpop_http, model):
    body = json.dumps({"text_input": PROMPT, "max_tokens": 8}).encode()
    url = f"http://{triton_server.http_url}/v2/models/{model}/generate"
    with urllib.request.urlopen(urllib.request.Request(url, data=body), timeout=60) as response:
        answer = json.loads(response.read())
    assert answer["output_ids"] == kvpop_http.generate(PROMPT, max_tokens=8).output_ids
    assert answer["finish_reason"] == "length" and answer["num_output_tokens"] == 8


def test_generate_stream_sends_server_sent_events(triton_server):
    body = json.dumps({"text_input": PROMPT, "max_tokens": 5, "stream": True}).encode()
    url = f"http://{triton_server.http_url}/v2/models/kvpop_engine/generate_stream"
    with urllib.request.urlopen(urllib.request.Request(url, data=body), timeout=60) as response:
        events = [json.loads(line[5:]) for line in response.read().decode().splitlines() if line.startswith("data:")]
    assert len(events) == 5
    assert [event["finish_reason"] for event in events] == ["", "", "", "", "length"]
    assert events[-1]["num_output_tokens"] == 5
