"""A stop string never reaches a client, on any route, streamed or not: the answer is the text before it,
even when the stop string ends inside a token (the rest of that token is dropped too), and usage counts
every token generated (the stop string's included)."""

from __future__ import annotations

import http.client
import json
import urllib.request

import numpy as np
import openai
import pytest

pytestmark = pytest.mark.server

MESSAGES = [{"role": "user", "content": "Let a = 7 and b = 5. What is a + b?"}]
TOKENS = 24
OPTIONS = {"max_tokens": TOKENS, "ignore_eos": True}  # greedy: every route generates the same tokens


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


@pytest.fixture(scope="module")
def reference(triton_server, tiny_onnx_model_dir) -> tuple[str, str]:
    """The greedy answer without a stop string, and a stop string that ends one character into one of its
    tokens of two or more characters (whose first occurrence is there)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_onnx_model_dir / "tokenizer")
    answer = post(f"http://{triton_server.http_url}/v2/models/kvpop_service/generate",
                  {"messages": json.dumps(MESSAGES), **OPTIONS})
    text, ids = answer["text_output"], answer["output_ids"]
    assert len(ids) == TOKENS and tokenizer.decode(ids, skip_special_tokens=True) == text
    ends = [len(tokenizer.decode(ids[:count], skip_special_tokens=True)) for count in range(len(ids) + 1)]
    for index in range(2, len(ids)):
        start, end = ends[index], ends[index + 1]
        stop = text[max(0, start - 3) : start + 1]
        if end - start >= 2 and stop.strip() and "\ufffd" not in stop and text.index(stop) == max(0, start - 3):
            return text, stop
    pytest.fail(f"no token of two characters or more in the greedy answer {text!r}")


def sse_texts(host: str, path: str, body: dict, field) -> list[str]:
    connection = http.client.HTTPConnection(host, timeout=60)
    connection.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    response = connection.getresponse()
    assert response.status == 200, response.read()
    texts = []
    for line in response.read().decode().splitlines():
        if line.startswith("data: {"):
            texts.append(field(json.loads(line[6:])))
    connection.close()
    return texts


def kserve_answers(triton_server, kvpop_http, kvpop_grpc, stop: str) -> dict[str, tuple[str, int]]:
    """(text, tokens counted) per KServe route."""
    answers = {}
    for name, client in (("service HTTP /infer", kvpop_http), ("service gRPC infer", kvpop_grpc)):
        result = client.chat(MESSAGES, stop=[stop], **OPTIONS)
        answers[name] = (result.text, result.num_output_tokens)
    for name, client in (("engine gRPC stream", kvpop_grpc), ("engine HTTP generate_stream", kvpop_http)):
        chunks = list(client.stream_chat(MESSAGES, stop=[stop], **OPTIONS))
        result = chunks[-1].result  # the chunks' text and tokens joined, checked against the final counts
        assert result.text == "".join(chunk.text for chunk in chunks) and len(result.output_ids) == result.num_output_tokens
        answers[name] = (result.text, result.num_output_tokens)
    body = {"messages": json.dumps(MESSAGES), "stop": [stop], **OPTIONS}
    for model in ("kvpop_service", "kvpop_engine"):
        answer = post(f"http://{triton_server.http_url}/v2/models/{model}/generate", body)
        answers[f"{model} HTTP generate"] = (answer["text_output"], answer["num_output_tokens"])
    return answers


def openai_answers(openai_api: str, stop: str) -> dict[str, tuple[str, int]]:
    client = openai.OpenAI(base_url=openai_api + "/v1", api_key="unused", max_retries=0)
    answers = {}
    chat = client.chat.completions.create(model="kvpop_engine", messages=MESSAGES, stop=[stop], max_tokens=TOKENS,
                                          extra_body={"ignore_eos": True})
    answers["/v1/chat/completions"] = (chat.choices[0].message.content, chat.usage.completion_tokens)
    chunks = list(client.chat.completions.create(model="kvpop_engine", messages=MESSAGES, stop=stop, max_tokens=TOKENS,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    answers["/v1/chat/completions stream"] = ("".join(chunk.choices[0].delta.content or "" for chunk in chunks
                                                      if chunk.choices), chunks[-1].usage.completion_tokens)
    # The chat template rendered by the engine: the same prompt through /v1/completions, streamed or not.
    body = {"model": "kvpop_engine", "messages": MESSAGES, "stop": [stop], "max_tokens": TOKENS, "ignore_eos": True}
    host = openai_api.removeprefix("http://")
    streamed = sse_texts(host, "/v1/chat/completions", {**body, "stream": True},
                         lambda event: event["choices"][0]["delta"].get("content", "") if event["choices"] else "")
    answers["/v1/chat/completions raw SSE"] = ("".join(streamed), chunks[-1].usage.completion_tokens)
    return answers


def test_a_stop_string_never_appears_in_any_answer(triton_server, kvpop_http, kvpop_grpc, openai_api, reference):
    text, stop = reference
    expected = text[: text.index(stop)]
    answers = {**kserve_answers(triton_server, kvpop_http, kvpop_grpc, stop), **openai_answers(openai_api, stop)}
    for route, (answer, tokens) in answers.items():
        assert answer == expected, (route, answer, expected, stop)
        assert stop not in answer and tokens <= TOKENS, route
    # Usage counts the tokens generated, the stop string's included: the same number on every route.
    assert len({tokens for _, tokens in answers.values()}) == 1, answers
    assert np.all([tokens > 0 for _, tokens in answers.values()])


def test_completions_cut_before_a_stop_string_streamed_or_not(openai_api, triton_server):
    """/v1/completions (a raw prompt) against the engine's raw prompt, streamed or not."""
    prompt = "a = 7 ; b = a ; b ="
    reference = post(f"http://{triton_server.http_url}/v2/models/kvpop_service/generate",
                     {"text_input": prompt, "raw_prompt": True, **OPTIONS})["text_output"]
    stop = reference[len(reference) // 2 : len(reference) // 2 + 2]
    if not stop.strip():
        stop = reference.strip()[:2]
    expected = reference[: reference.index(stop)]
    client = openai.OpenAI(base_url=openai_api + "/v1", api_key="unused", max_retries=0)
    complete = client.completions.create(model="kvpop_engine", prompt=prompt, stop=stop, max_tokens=TOKENS,
                                         extra_body={"ignore_eos": True})
    streamed = "".join(chunk.choices[0].text for chunk in client.completions.create(
        model="kvpop_engine", prompt=prompt, stop=stop, max_tokens=TOKENS, stream=True,
        extra_body={"ignore_eos": True}) if chunk.choices)
    assert complete.choices[0].text == streamed == expected and complete.choices[0].finish_reason == "stop"
