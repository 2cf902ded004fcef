"""Bad input gets a clear per-request error; the server stays up and other requests are unaffected."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

pytestmark = pytest.mark.server
MODEL = "kvpop_service"


def tensor(module, name, value, datatype):
    array = np.array(value, dtype=np.object_ if datatype == "BYTES" else None)
    if datatype != "BYTES":
        array = array.astype({"INT32": np.int32, "INT64": np.int64, "FP32": np.float32, "BOOL": bool}[datatype])
    item = module.InferInput(name, list(array.shape), datatype)
    item.set_data_from_numpy(array)
    return item


GOOD_TEXT = ("text_input", [[b"Let a = 7."]], "BYTES")
BAD_REQUESTS = {
    "no prompt": ([("max_tokens", [[4]], "INT32")], "exactly one of text_input"),
    # text_input and input_ids together: a non-empty text_input wins (perf_analyzer sends both)
    "text and messages": ([GOOD_TEXT, ("messages", [[b'[{"role": "user", "content": "hi"}]']], "BYTES")],
                          "exactly one of text_input"),
    "empty text": ([("text_input", [[b"   "]], "BYTES")], "empty"),
    "empty ids": ([("input_ids", np.zeros((1, 0), np.int32), "INT32")], "input_ids is empty"),
    "invalid utf-8": ([("text_input", [[b"\xff\xfe bad"]], "BYTES")], "not valid UTF-8"),
    "oversized prompt": ([("input_ids", [list(range(3, 303)) * 2], "INT32")], "at most 512"),
    "token out of vocabulary": ([("input_ids", [[1, 2, 99999]], "INT32")], "out of range"),
    "negative temperature": ([GOOD_TEXT, ("temperature", [[-1.0]], "FP32")], "temperature"),
    "top_p above one": ([GOOD_TEXT, ("top_p", [[1.5]], "FP32")], "top_p"),  # 0 means not sent (perf_analyzer)
    "negative top_k": ([GOOD_TEXT, ("top_k", [[-3]], "INT32")], "top_k"),
    "negative seed": ([GOOD_TEXT, ("temperature", [[1.0]], "FP32"), ("seed", [[-5]], "INT64")], "seed"),
    "max_tokens negative": ([GOOD_TEXT, ("max_tokens", [[-1]], "INT32")], "max_tokens"),  # 0: the default
    "max_tokens huge": ([GOOD_TEXT, ("max_tokens", [[100000]], "INT32")], "max_tokens"),
    "unknown policy": ([GOOD_TEXT, ("eviction_policy", [[b"lru"]], "BYTES")], "unknown eviction policy"),
    "negative budget": ([GOOD_TEXT, ("eviction_policy", [[b"h2o"]], "BYTES"), ("kv_budget", [[-1]], "INT32")], "budget"),
    "compression above one": ([GOOD_TEXT, ("eviction_policy", [[b"tova"]], "BYTES"),
                               ("compression_ratio", [[1.5]], "FP32")], "compression"),
    "budget with full": ([GOOD_TEXT, ("kv_budget", [[16]], "INT32")], "full"),
    "wrong dtype": ([GOOD_TEXT, ("max_tokens", [[4.0]], "FP32")], "max_tokens"),
    "wrong shape": ([GOOD_TEXT, ("max_tokens", [[4, 5]], "INT32")], "max_tokens"),
    "infinite temperature": ([GOOD_TEXT, ("temperature", [[np.inf]], "FP32")], "temperature"),
    "nan top_p": ([GOOD_TEXT, ("top_p", [[np.nan]], "FP32")], "top_p"),
    "wrong ids dtype": ([("input_ids", [[1, 2]], "INT64")], "input_ids"),
}
# What each transport reports for a client mistake (never 500 / INTERNAL).
INVALID = {"http": "400", "grpc": "StatusCode.INVALID_ARGUMENT"}


@pytest.mark.parametrize("protocol", ["http", "grpc"])
@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_request_gets_a_clear_error(triton_server, protocol, case):
    module = httpclient if protocol == "http" else grpcclient
    url = triton_server.http_url if protocol == "http" else triton_server.grpc_url
    inputs, message = BAD_REQUESTS[case]
    with module.InferenceServerClient(url) as client:
        with pytest.raises(module.InferenceServerException, match=f"(?i){message}") as raised:
            client.infer(MODEL, [tensor(module, *item) for item in inputs])
        assert raised.value.status() == INVALID[protocol], raised.value
        assert client.is_server_live() and client.is_model_ready(MODEL)


def test_hostile_request_ids_are_harmless(triton_server):
    with httpclient.InferenceServerClient(triton_server.http_url) as client:
        for request_id in ["../../etc/passwd", "x" * 10_000, "\x00\n{}'\";--", "üñí©ødé"]:
            result = client.infer(MODEL, [tensor(httpclient, *GOOD_TEXT)], request_id=request_id)
            assert result.as_numpy("num_output_tokens")[0, 0] > 0


def test_bad_requests_do_not_disturb_good_ones_in_the_same_batch(triton_server, kvpop_http):
    expected = kvpop_http.generate("Let a = 7.", max_tokens=8).output_ids
    cases = list(BAD_REQUESTS.values())

    def send(index):
        with httpclient.InferenceServerClient(triton_server.http_url) as client:
            if index % 2:
                inputs, _ = cases[index % len(cases)]
                try:
                    client.infer(MODEL, [tensor(httpclient, *item) for item in inputs])
                except httpclient.InferenceServerException:
                    return "error"
                return "accepted"
            limit = tensor(httpclient, "max_tokens", [[8]], "INT32")
            return client.infer(MODEL, [tensor(httpclient, *GOOD_TEXT), limit]).as_numpy("output_ids")[0].tolist()

    with ThreadPoolExecutor(16) as pool:
        outcomes = list(pool.map(send, range(32)))
    assert outcomes[0::2] == [expected] * 16
    assert outcomes[1::2] == ["error"] * 16
