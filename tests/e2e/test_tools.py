"""End-to-end: exactly what the common Triton LLM benchmark tools send (genai-perf in kserve and generate
mode, perf_analyzer with its own synthetic data) against the real server.

genai-perf's request shapes are written out here (its TensorRT-LLM and vLLM converters), so the test
needs no tokenizer from the hub. perf_analyzer is the real binary when KVPOP_PERF_ANALYZER names it
(the `tritonclient==2.51.0` wheel's `data/bin/perf_analyzer`; KVPOP_PERF_ANALYZER_LIBS is put on
LD_LIBRARY_PATH for its libb64.so.0d and libcudart.so.12), skipped otherwise.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import urllib.error
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

PROMPT = "The quick brown fox jumps over the lazy dog"


def _input(name, value, datatype):
    array = np.array([[value]], dtype=np.object_ if datatype == "BYTES" else None)
    if datatype == "INT32":
        array = array.astype(np.int32)
    if datatype == "BOOL":
        array = array.astype(np.bool_)
    tensor = grpcclient.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array)
    return tensor


def _stream(triton_server, inputs):
    """gRPC streaming to kvpop_engine, as genai-perf's kserve mode does; returns (tokens text, errors)."""
    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(triton_server.grpc_url)
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        client.async_stream_infer("kvpop_engine", inputs, request_id="genai-perf-1",
                                  enable_empty_final_response=True)
        texts, errors = [], []
        while True:
            result, error = results.get(timeout=60)
            if error is not None:
                errors.append(str(error))
                break
            if result.as_numpy("text_output") is not None:
                texts.append(result.as_numpy("text_output").reshape(-1)[0].decode())
            final = result.get_response().parameters.get("triton_final_response")
            if final is not None and final.bool_param:
                break
        return texts, errors
    finally:
        client.stop_stream()
        client.close()


def test_genai_perf_kserve_tensorrtllm_request(triton_server):
    """genai-perf --service-kind triton --backend tensorrtllm --streaming --output-tokens-mean 8
    --output-tokens-mean-deterministic: text_input, max_tokens, min_length = max_tokens, stream,
    exclude_input_in_output."""
    inputs = [_input("text_input", PROMPT.encode(), "BYTES"), _input("max_tokens", 8, "INT32"),
              _input("min_length", 8, "INT32"), _input("stream", True, "BOOL"),
              _input("exclude_input_in_output", True, "BOOL"), _input("beam_width", 1, "INT32")]
    texts, errors = _stream(triton_server, inputs)
    assert not errors, errors
    assert len([text for text in texts if text]) >= 1


def test_genai_perf_kserve_vllm_request(triton_server):
    """genai-perf 0.0.16 --backend vllm --output-tokens-mean 8 --output-tokens-mean-deterministic: text_input,
    stream, exclude_input_in_output and sampling_parameters, its numbers as JSON strings (its inputs.json)."""
    sampling = '{"max_tokens":"8","min_tokens":"8"}'
    inputs = [_input("text_input", PROMPT.encode(), "BYTES"), _input("stream", True, "BOOL"),
              _input("exclude_input_in_output", True, "BOOL"),
              _input("sampling_parameters", sampling.encode(), "BYTES")]
    texts, errors = _stream(triton_server, inputs)
    assert not errors, errors


def _post(url, body):
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def test_genai_perf_generate_mode(triton_server):
    """genai-perf --endpoint-type generate: POST /generate (service) and, with --streaming and
    --endpoint v2/models/kvpop_engine/generate_stream, the engine's SSE stream (its inputs.json)."""
    base = f"http://{triton_server.http_url}/v2/models"
    status, body = _post(f"{base}/kvpop_service/generate", {"text_input": [PROMPT], "max_tokens": 8})
    assert status == 200, body
    status, body = _post(f"{base}/kvpop_service/generate",
                         {"text_input": PROMPT, "max_tokens": 8, "min_length": 8, "exclude_input_in_output": True})
    assert status == 200, body
    answer = json.loads(body)
    assert answer["num_output_tokens"] == 8
    status, body = _post(f"{base}/kvpop_engine/generate_stream",
                         {"text_input": [PROMPT], "stream": True, "max_tokens": 8})
    assert status == 200, body
    assert body.count("data:") >= 2


@pytest.mark.parametrize("extra, words", [
    ({"beam_width": 2}, "beam_width"),
    ({"repetition_penalty": 1.3}, "repetition_penalty"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"frequency_penalty": 0.5}, "frequency_penalty"),
    ({"min_length": 3}, "min_length"),
    ({"min_tokens": 20}, "min_tokens"),
    ({"sampling_parameters": json.dumps({"n": 2})}, "sampling_parameters.n"),
    ({"sampling_parameters": json.dumps({"use_beam_search": True})}, "unsupported keys"),
])
def test_unsupported_settings_are_refused_with_400(triton_server, extra, words):
    status, body = _post(f"http://{triton_server.http_url}/v2/models/kvpop_service/generate",
                         {"text_input": PROMPT, "max_tokens": 8, **extra})
    assert status == 400, body
    assert words in body


def test_exclude_input_in_output_false_echoes_the_prompt(triton_server):
    base = f"http://{triton_server.http_url}/v2/models"
    status, body = _post(f"{base}/kvpop_service/generate",
                         {"text_input": PROMPT, "max_tokens": 4, "exclude_input_in_output": False})
    assert status == 200, body
    answer = json.loads(body)
    assert answer["text_output"].startswith(PROMPT)
    status, plain = _post(f"{base}/kvpop_service/generate", {"text_input": PROMPT, "max_tokens": 4})
    assert answer["text_output"] == PROMPT + json.loads(plain)["text_output"] or answer["text_output"].endswith(
        json.loads(plain)["text_output"])
    status, body = _post(f"{base}/kvpop_engine/generate_stream",
                         {"text_input": PROMPT, "max_tokens": 4, "stream": True, "exclude_input_in_output": False})
    assert status == 400 or "exclude_input_in_output" in body, body


def test_every_optional_input_at_zero_like_perf_analyzer(triton_server):
    """perf_analyzer --input-data=zero sends every optional input: zeros, false and empty strings.
    Zero means "not sent"; an empty text_input gives way to input_ids."""
    client = grpcclient.InferenceServerClient(triton_server.grpc_url)
    try:
        metadata = client.get_model_metadata("kvpop_service", as_json=True)
        inputs = []
        for spec in metadata["inputs"]:
            shape = [1, 4] if spec["name"] == "input_ids" else [1, 1]
            if spec["datatype"] == "BYTES":
                array = np.full(shape, b"", dtype=np.object_)
            else:
                array = np.zeros(shape, dtype=grpcclient.triton_to_np_dtype(spec["datatype"]))
            tensor = grpcclient.InferInput(spec["name"], shape, spec["datatype"])
            tensor.set_data_from_numpy(array)
            inputs.append(tensor)
        result = client.infer("kvpop_service", inputs)
        assert result.as_numpy("num_input_tokens").reshape(-1)[0] == 4
        assert result.as_numpy("num_output_tokens").reshape(-1)[0] >= 1
        # text_input non-empty: it wins over input_ids
        for tensor in inputs:
            if tensor.name() == "text_input":
                tensor.set_data_from_numpy(np.array([[PROMPT.encode()]], dtype=np.object_))
        result = client.infer("kvpop_service", inputs)
        assert result.as_numpy("num_input_tokens").reshape(-1)[0] != 4
    finally:
        client.close()


@pytest.mark.skipif(not os.environ.get("KVPOP_PERF_ANALYZER"), reason="set KVPOP_PERF_ANALYZER to the perf_analyzer binary")
def test_real_perf_analyzer_with_zero_data(triton_server):
    env = {**os.environ, "LD_LIBRARY_PATH": os.environ.get("KVPOP_PERF_ANALYZER_LIBS", "")}
    command = [os.environ["KVPOP_PERF_ANALYZER"], "-m", "kvpop_service", "-u", triton_server.http_url,
               "--input-data=zero", "--string-data", " ", "--shape", "input_ids:16", "--shape", "stop:1",
               "-H", "kvpop-admin-key:e2e-admin-key",
               "--measurement-mode=count_windows", "--measurement-request-count=10",
               "--stability-percentage=100", "--max-trials=5"]
    run = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    print(" ".join(command))
    print(run.stdout[-2500:], run.stderr[-1500:])
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "Throughput:" in run.stdout
