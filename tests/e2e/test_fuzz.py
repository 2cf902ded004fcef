"""Property-based requests against the real server and the OpenAI API: whatever a client sends (any JSON,
any text, lone surrogates included, any integer, wrong types, bytes that are not UTF-8, made-up routes),
the answer is a well-formed result or a documented client error (400 / 404 / 405 / 413, or 503 when
overloaded) with its documented body, never a 500 or a hang, and the servers count no internal error.
`make test` runs a short budget; `make test-fuzz` a long one (HYPOTHESIS_EXAMPLES)."""

from __future__ import annotations

import http.client
import json
import math
import os
import re
import urllib.error
import urllib.request

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.e2e.conftest import metric_reader

pytestmark = [pytest.mark.server, pytest.mark.fuzz]
EXAMPLES = int(os.environ.get("HYPOTHESIS_EXAMPLES", "200"))  # per property: about 30 s in all
FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)

floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-10, 10), st.just(0.5))
ints = st.one_of(st.integers(-2, 12), st.integers(-(2**40), 2**40), st.just(2**31))
# Every code point, lone surrogates included (JSON escapes them: "\ud800"), and the edges of the wire types.
# Triton 2.51's own HTTP JSON parser answers 500 to a lone surrogate before any model sees the request
# (docs/API.md, errors): on the KServe routes they travel inside the JSON strings the models parse themselves
# (`messages`, `sampling_parameters`), and the OpenAI API gets them anywhere.
any_text = st.one_of(st.text(st.characters(exclude_categories=()), max_size=24),
                     st.sampled_from(["\ud800", "a\udfffb", "\x00", "kvpop", "streaming", "full", " ", "Let a = 7."]))
plain_text = st.one_of(st.text(max_size=24), st.sampled_from(["\x00", "kvpop", "streaming", "full", " ", "Let a = 7."]))
any_int = st.one_of(st.integers(), st.sampled_from([0, -1, 2**31 - 1, 2**31, 2**32 - 1, 2**32 + 3, 2**63, 2**64, -(2**63) - 1]))


def json_values(text):
    scalar = st.one_of(any_int, floats, text, st.booleans(), st.none())
    return st.recursive(scalar, lambda children: st.one_of(st.lists(children, max_size=4),
                                                           st.dictionaries(text, children, max_size=4)), max_leaves=12)


any_json = json_values(any_text)
plain_json = json_values(plain_text)
embedded_json = any_json.map(json.dumps)  # JSON inside a string: its surrogates are escaped as ASCII
strings = st.one_of(st.sampled_from(["full", "streaming", "h2o", "tova", "random", "kvpop", "", "lru"]), st.text(max_size=20))
scalars = st.one_of(ints, floats, strings, st.booleans())
DATATYPES = ["INT32", "INT64", "FP32", "BYTES", "BOOL", "UINT8"]
ERROR_STATUSES = (400, 404, 405, 413, 503)


def _finite(value) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, dict):
        return all(map(_finite, value.values()))
    if isinstance(value, list):
        return all(map(_finite, value))
    return True


def send(url: str, method: str, path: str, body: bytes | None) -> tuple[int, bytes]:
    request = urllib.request.Request(url + path, data=body, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def encoded(body) -> bytes | None:
    """JSON as clients send it (lone surrogates escaped), or None where JSON cannot carry the value (nan)."""
    return json.dumps(body, allow_nan=False).encode() if _finite(body) else None


# -- KServe: kvpop_service /infer (tensors), /generate (flat JSON), kvpop_engine /generate_stream (SSE) ------

@st.composite
def tensors(draw, name: str):
    datatype = draw(st.sampled_from(DATATYPES))
    shape = draw(st.sampled_from([[1, 1], [1, 2], [2, 1], [1, 0], [1], [1, 3]]))
    count = math.prod(shape)
    # Values fit their declared datatype: Triton 2.51's HTTP JSON parser itself answers 500 for, e.g.,
    # -1 as UINT8, before any model sees the request (docs/API.md, errors).
    element = {"BYTES": st.one_of(plain_text, embedded_json, st.sampled_from(["Let a = 7.", " "])),
               "BOOL": st.booleans(), "FP32": floats, "UINT8": st.integers(0, 255),
               "INT32": st.integers(-(2**31), 2**31 - 1)}.get(datatype, ints)
    data = draw(st.lists(element, min_size=count, max_size=count))
    if datatype == "FP32":
        data = [value if isinstance(value, (int, float)) and math.isfinite(value) else 0.0 for value in data]
    return {"name": name, "datatype": datatype, "shape": shape, "data": data}


@st.composite
def infer_requests(draw):
    inputs = []
    prompt = draw(st.sampled_from(["text", "ids", "both", "none", "messages"]))
    if prompt in ("text", "both"):
        inputs.append(draw(st.one_of(tensors("text_input"), st.just(
            {"name": "text_input", "datatype": "BYTES", "shape": [1, 1], "data": ["Let a = 7. What is a?"]}))))
    if prompt in ("ids", "both"):
        ids = draw(st.lists(st.integers(-5, 600), min_size=0, max_size=40))
        inputs.append(draw(st.one_of(tensors("input_ids"), st.just(
            {"name": "input_ids", "datatype": "INT32", "shape": [1, len(ids)], "data": ids}))))
    if prompt == "messages":
        messages = draw(st.one_of(any_json, st.just([{"role": "user", "content": draw(any_text)}])))  # in a string
        inputs.append({"name": "messages", "datatype": "BYTES", "shape": [1, 1], "data": [json.dumps(messages)]})
    for name in sorted(draw(st.sets(st.sampled_from(["max_tokens", "temperature", "top_p", "top_k", "seed", "ignore_eos",
                                                      "eviction_policy", "kv_budget", "compression_ratio", "stop",
                                                      "session_id", "sampling_parameters"])))):
        inputs.append(draw(tensors(name)))
        if name == "max_tokens" and inputs[-1]["datatype"] == "INT32":  # short generations: at most the default
            inputs[-1]["data"] = [value if not 64 < value <= 2**16 else 4 for value in inputs[-1]["data"]]
    parameters = draw(st.dictionaries(st.sampled_from(["max_tokens", "temperature", "top_p", "kv_budget", "stream",
                                                       "compression_ratio", "eviction_policy", "seed", "stop", "session_id",
                                                       "text_input", "messages", "confidence_threshold", "x" * 300]),
                                      st.one_of(scalars, any_int, plain_json), max_size=4))
    return {"inputs": inputs, "parameters": parameters}


def check_kserve_answer(status: int, data: bytes, where) -> dict:
    answer = json.loads(data or b"{}")
    assert status in (200, 400, 503), (status, answer, where)
    if status != 200:
        assert isinstance(answer.get("error"), str) and answer["error"], (answer, where)
        assert "internal" not in answer["error"][:60], (answer, where)
    return answer


@FUZZ
@given(body=infer_requests())
def test_any_infer_request_gets_an_answer_or_a_client_error(triton_server, body):
    body = {"inputs": body["inputs"], "parameters": {**body["parameters"], "max_tokens": 4}}  # keep it fast
    data = encoded(body)
    if data is None:
        return  # JSON cannot carry nan/inf; the typed clients' tests cover those
    status, raw = send(f"http://{triton_server.http_url}", "POST", "/v2/models/kvpop_service/infer", data)
    answer = check_kserve_answer(status, raw, body)
    if status == 200:
        outputs = {item["name"]: item["data"] for item in answer["outputs"]}
        # A max_tokens input wins over the parameter; at 0 it counts as not sent: the default (64).
        limit = 64 if any(item["name"] == "max_tokens" for item in body["inputs"]) else 4
        assert all(0 < count <= limit for count in outputs["num_output_tokens"]), (outputs, body)


# The flat-JSON routes turn a field named as an input into a tensor of its declared type, and Triton 2.51's
# own parser answers 500 to a JSON value of another type (a number for BYTES) before any model sees it
# (docs/API.md, errors): an input's field gets any value of its type; every other field is a request
# parameter, and gets any JSON at all (any integer, as request parameters of /infer do too).
texts = st.one_of(plain_text, embedded_json)
int32 = st.integers(-(2**31), 2**31 - 1)
GENERATE_FIELDS = {
    "text_input": texts, "messages": texts, "eviction_policy": texts, "session_id": texts, "sampling_parameters": texts,
    "stop": st.one_of(texts, st.lists(texts, max_size=3)), "max_tokens": int32, "top_k": int32,
    "kv_budget": int32, "seed": st.integers(0, 2**64 - 1), "temperature": floats, "top_p": floats, "compression_ratio": floats,
    "ignore_eos": st.booleans(), "stream": st.booleans(), "raw_prompt": plain_json, "unknown_field": plain_json,
    "confidence_threshold": plain_json,
}


@st.composite
def generate_fields(draw) -> dict:
    return {name: draw(GENERATE_FIELDS[name]) for name in sorted(draw(st.sets(st.sampled_from(sorted(GENERATE_FIELDS)), max_size=6)))}


@FUZZ
@given(fields=generate_fields(), prompt=plain_text, streamed=st.booleans())
def test_any_generate_request_gets_an_answer_or_a_client_error(triton_server, fields, prompt, streamed):
    """kvpop_service /generate and kvpop_engine /generate_stream: any value for any field."""
    body = {"text_input": prompt, **fields, "max_tokens": 4}
    data = encoded(body)
    if data is None:
        return
    path = "/v2/models/kvpop_engine/generate_stream" if streamed else "/v2/models/kvpop_service/generate"
    status, raw = send(f"http://{triton_server.http_url}", "POST", path, data)
    if streamed and raw.startswith(b"data: "):  # server-sent events, an error among them (400 before the first)
        assert status in (200, 400), (status, raw, body)
        events = [json.loads(line[6:]) for line in raw.decode().splitlines() if line.startswith("data: ")]
        errors = [event["error"] for event in events if "error" in event]
        assert all("internal" not in error[:60] for error in errors), (errors, body)
        return
    check_kserve_answer(status, raw, body)


# -- the OpenAI API -------------------------------------------------------------------------------------

MESSAGES = st.one_of(any_json, st.lists(st.fixed_dictionaries(
    {"role": st.one_of(st.sampled_from(["user", "system", "assistant", "developer", "tool"]), any_text),
     "content": st.one_of(any_text, any_json, st.just([{"type": "text", "text": "hi"}]))}), min_size=1, max_size=3))
OPENAI_FIELDS = {
    "model": st.one_of(st.just("kvpop_engine"), any_json), "messages": MESSAGES,
    "prompt": st.one_of(any_text, any_json), "max_tokens": st.one_of(st.integers(-3, 4), any_int, any_json),
    "max_completion_tokens": st.one_of(st.integers(-3, 4), any_json), "temperature": st.one_of(floats, any_json),
    "top_p": st.one_of(floats, any_json), "seed": st.one_of(any_int, any_json), "stop": st.one_of(any_text, any_json),
    "n": any_json, "stream": st.one_of(st.booleans(), any_json), "stream_options": any_json,
    "eviction_policy": st.one_of(strings, any_json), "kv_budget": st.one_of(any_int, any_json),
    "compression_ratio": st.one_of(floats, any_json), "session_id": st.one_of(any_text, any_json),
    "ignore_eos": any_json, "logprobs": any_json, "tools": any_json, "user": any_json,
}


@st.composite
def openai_bodies(draw):
    body = {"model": "kvpop_engine"}
    body["messages" if draw(st.booleans()) else "prompt"] = "Let a = 7. What is a?"
    for name in sorted(draw(st.sets(st.sampled_from(sorted(OPENAI_FIELDS)), max_size=5))):
        body[name] = draw(OPENAI_FIELDS[name])
    body.update(draw(st.dictionaries(any_text, any_json, max_size=2)))
    if isinstance(body.get("max_tokens"), int) and not isinstance(body["max_tokens"], bool) and 4 < body["max_tokens"] < 2**16:
        body["max_tokens"] = 4  # keep generations short (larger ones that are valid are no different)
    if body.get("max_tokens") is None:  # absent or null: the service's default length, far longer than 4
        body["max_tokens"] = 4
    return body


def check_openai_answer(status: int, data: bytes, streamed: bool, where) -> None:
    assert status in (200, *ERROR_STATUSES), (status, data[:500], where)
    if status == 200 and streamed:
        events = [line[6:] for line in data.decode().splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]", (events, where)
        for event in map(json.loads, events[:-1]):
            if "error" in event:
                assert event["error"]["type"] != "server_error", (event, where)
        return
    answer = json.loads(data)
    if status == 200:
        assert answer["choices"] and answer["usage"]["completion_tokens"] <= 4, (answer, where)
        return
    assert set(answer) == {"error"} and set(answer["error"]) == {"message", "type", "param", "code"}, (answer, where)
    assert answer["error"]["message"] and answer["error"]["type"] != "server_error", (answer, where)
    param = answer["error"]["param"]
    fields = where if isinstance(where, dict) else {}
    assert param is None or not str(param).isdigit() or param in fields, (answer, where)  # a field, never a byte offset


@FUZZ
@given(body=openai_bodies(), chat=st.booleans())
def test_any_openai_body_gets_an_answer_or_an_openai_error(openai_api, body, chat):
    data = encoded(body)
    if data is None:
        return
    path = "/v1/chat/completions" if chat else "/v1/completions"
    status, raw = send(openai_api, "POST", path, data)
    check_openai_answer(status, raw, body.get("stream") is True and status == 200, body)


TEXT_FIELDS = {  # a valid request with one string replaced
    "prompt": lambda body, text: {**body, "prompt": text},
    "prompt list": lambda body, text: {**body, "prompt": [text]},
    "message": lambda body, text: {**body, "messages": [{"role": "user", "content": text}]},
    "message part": lambda body, text: {**body, "messages": [{"role": "user", "content": [{"type": "text", "text": text}]}]},
    "stop": lambda body, text: {**body, "stop": text},
    "stop list": lambda body, text: {**body, "stop": ["never", text]},
    "session_id": lambda body, text: {**body, "session_id": text},
    "eviction_policy": lambda body, text: {**body, "eviction_policy": text},
    "user": lambda body, text: {**body, "user": text},
    "key": lambda body, text: {**body, text: 1},
}


@FUZZ
@given(field=st.sampled_from(sorted(TEXT_FIELDS)), text=any_text, chat=st.booleans())
def test_any_text_in_any_string_field_gets_an_answer_or_an_openai_error(openai_api, field, text, chat):
    body = {"model": "kvpop_engine", "max_tokens": 2}
    body = TEXT_FIELDS[field]({**body, "messages": [{"role": "user", "content": "hi"}]} if chat else {**body, "prompt": "hi"},
                              text)
    status, raw = send(openai_api, "POST", "/v1/chat/completions" if chat else "/v1/completions", encoded(body))
    check_openai_answer(status, raw, False, body)


@FUZZ
@given(method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH"]),
       path=st.one_of(st.sampled_from(["/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/models/kvpop_engine"]),
                      st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E, exclude_characters="?#%"), max_size=30)
                      .map(lambda tail: "/v1/" + tail)),
       body=st.one_of(st.binary(max_size=64), any_json.map(lambda value: json.dumps(value).encode())))
def test_any_route_method_and_bytes_get_an_openai_answer(openai_api, method, path, body):
    host = openai_api.removeprefix("http://")
    connection = http.client.HTTPConnection(host, timeout=120)
    connection.request(method, path, body if method in ("POST", "PUT", "PATCH") else None,
                       {"Content-Type": "application/json"})
    response = connection.getresponse()
    status, data = response.status, response.read()
    connection.close()
    if status == 200 and method == "GET":
        assert json.loads(data)["object"] in ("list", "model")
        return
    check_openai_answer(status, data, False, (method, path, body))


def test_the_servers_counted_no_internal_error(triton_server, openai_api, openai_api_log):
    """After everything above: no 5xx but 503 from the OpenAI API, no internal error in the engine, and
    no traceback in either server's log."""
    with urllib.request.urlopen(openai_api + "/metrics", timeout=10) as response:
        counted = re.findall(r'kvpop_openai_requests_total\{route="[^"]*",status="(\d+)"\} (\S+)', response.read().decode())
    assert sum(float(count) for status, count in counted if status.startswith("5") and status != "503") == 0, counted
    read = metric_reader(triton_server.metrics_url)
    assert read("kvpop_rejected_requests_total", reason="internal") == 0
    log = openai_api_log.read_text(errors="replace")
    assert "Traceback" not in log and "Exception in ASGI" not in log, log[-5000:]
    triton_log = triton_server.log_file.read_text(errors="replace")
    assert "Traceback" not in triton_log and "answering request" not in triton_log, triton_log[-5000:]
