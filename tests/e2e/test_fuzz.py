"""Property-based requests against the real server: whatever a client sends to kvpop_service, the
answer is a well-formed result or a 400 / 503 with a message, never a 500 or a hang, and the server
stays up. `make test` runs a short budget; `make test-fuzz` a long one (HYPOTHESIS_EXAMPLES)."""

from __future__ import annotations

import json
import math
import os
import urllib.error
import urllib.request

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = [pytest.mark.server, pytest.mark.fuzz]
EXAMPLES = int(os.environ.get("HYPOTHESIS_EXAMPLES", "40"))

floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-10, 10), st.just(0.5))
ints = st.one_of(st.integers(-2, 12), st.integers(-(2**40), 2**40), st.just(2**31))
strings = st.one_of(st.sampled_from(["full", "streaming", "h2o", "tova", "random", "kvpop", "", "lru"]), st.text(max_size=20))
scalars = st.one_of(ints, floats, strings, st.booleans())
DATATYPES = ["INT32", "INT64", "FP32", "BYTES", "BOOL", "UINT8"]


@st.composite
def tensors(draw, name: str):
    datatype = draw(st.sampled_from(DATATYPES))
    shape = draw(st.sampled_from([[1, 1], [1, 2], [2, 1], [1, 0], [1], [1, 3]]))
    count = math.prod(shape)
    # Values fit their declared datatype: Triton 2.51's HTTP JSON parser itself answers 500 for, e.g.,
    # -1 as UINT8, before any model sees the request (docs/RELIABILITY.md, known limits).
    element = {"BYTES": st.one_of(st.text(max_size=40), st.sampled_from(["Let a = 7.", " "])),
               "BOOL": st.booleans(), "FP32": floats, "UINT8": st.integers(0, 255),
               "INT32": st.integers(-(2**31), 2**31 - 1)}.get(datatype, ints)
    data = draw(st.lists(element, min_size=count, max_size=count))
    if datatype == "FP32":
        data = [value if isinstance(value, (int, float)) and math.isfinite(value) else 0.0 for value in data]
    return {"name": name, "datatype": datatype, "shape": shape, "data": data}


@st.composite
def requests(draw):
    inputs = []
    prompt = draw(st.sampled_from(["text", "ids", "both", "none"]))
    if prompt in ("text", "both"):
        inputs.append(draw(st.one_of(tensors("text_input"), st.just(
            {"name": "text_input", "datatype": "BYTES", "shape": [1, 1], "data": ["Let a = 7. What is a?"]}))))
    if prompt in ("ids", "both"):
        ids = draw(st.lists(st.integers(-5, 600), min_size=0, max_size=40))
        inputs.append(draw(st.one_of(tensors("input_ids"), st.just(
            {"name": "input_ids", "datatype": "INT32", "shape": [1, len(ids)], "data": ids}))))
    for name in draw(st.sets(st.sampled_from(["max_tokens", "temperature", "top_p", "top_k", "seed", "ignore_eos",
                                               "eviction_policy", "kv_budget", "compression_ratio", "stop"]))):
        inputs.append(draw(tensors(name)))
    parameters = draw(st.dictionaries(st.sampled_from(["max_tokens", "temperature", "top_p", "kv_budget", "stream",
                                                       "compression_ratio", "eviction_policy", "seed", "stop",
                                                       "confidence_threshold", "x" * 300]), scalars, max_size=4))
    return {"inputs": inputs, "parameters": parameters}


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(body=requests())
def test_any_request_gets_an_answer_or_a_client_error(triton_server, body):
    body = {"inputs": body["inputs"], "parameters": {**body["parameters"], "max_tokens": 4}}  # keep it fast
    data = json.dumps(body, allow_nan=False, default=str).encode() if _finite(body) else None
    if data is None:
        return  # JSON cannot carry nan/inf; the typed clients' tests cover those
    request = urllib.request.Request(f"http://{triton_server.http_url}/v2/models/kvpop_service/infer", data=data,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            status, answer = response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        status, answer = error.code, json.loads(error.read() or b"{}")
    assert status in (200, 400, 503), (status, answer, body)
    if status == 200:
        outputs = {item["name"]: item["data"] for item in answer["outputs"]}
        assert all(0 < count <= 4 for count in outputs["num_output_tokens"])
    else:
        assert answer.get("error"), answer
    with urllib.request.urlopen(f"http://{triton_server.http_url}/v2/health/ready", timeout=10) as response:
        assert response.status == 200


def _finite(value) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, dict):
        return all(map(_finite, value.values()))
    if isinstance(value, list):
        return all(map(_finite, value))
    return True
