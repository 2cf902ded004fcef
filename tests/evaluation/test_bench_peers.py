"""The CPU peers of the service benchmark: how each peer's stream is counted, token by token, and the ONNX
Runtime GenAI peer's server itself (when `make ortgenai-peer` has built it): exactly the asked tokens for
each of several concurrent requests, and a bad request refused alone while the server goes on serving."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvpop_eval.bench import llamacpp_peer, ortgenai_peer


def event(chunk: dict) -> bytes:
    return b"data: " + json.dumps(chunk).encode() + b"\n"


def test_llamacpp_events_count_their_tokens_and_the_stop_event_only_what_was_not_streamed():
    assert llamacpp_peer.tokens_in_event(event({"tokens": [5, 6], "content": "ab"}), 0) == 2
    assert llamacpp_peer.tokens_in_event(event({"content": "a"}), 2) == 1
    assert llamacpp_peer.tokens_in_event(event({"content": ""}), 3) == 0
    assert llamacpp_peer.tokens_in_event(b"\n", 3) == 0
    assert llamacpp_peer.tokens_in_event(event({"stop": True, "tokens": [7], "timings": {"predicted_n": 4}}), 3) == 1
    assert llamacpp_peer.tokens_in_event(event({"stop": True, "timings": {"predicted_n": 4}}), 4) == 0


def test_ortgenai_lines_count_one_token_each_and_an_error_line_fails_the_request():
    assert ortgenai_peer.tokens_in_line(b'{"token": 17}\n', 0) == 1
    assert ortgenai_peer.tokens_in_line(b'{"finish_reason": "MAX_GENERATED_TOKENS"}\n', 8) == 0
    with pytest.raises(RuntimeError, match="engine error"):
        ortgenai_peer.tokens_in_line(b'{"error": "engine error 3"}\n', 2)


def test_ortgenai_server_streams_exactly_the_asked_tokens_and_refuses_a_bad_request_alone(tmp_path):
    try:
        model = ortgenai_peer.model_dir("fp32")
    except FileNotFoundError as missing:
        pytest.skip(str(missing))
    from kvpop.serving.process.tritonserver import free_port

    process, url = ortgenai_peer.start_ortgenai(model, max_batch=3, max_length=64, threads=1, log=tmp_path / "server.log", port=free_port())
    try:
        prompts = [[1, 504, 3437, 314, 253], [1, 504, 3437, 314, 253], [1, 1812, 314]]
        with ThreadPoolExecutor(len(prompts)) as pool:
            timings = list(pool.map(lambda prompt: ortgenai_peer.ortgenai_request(url, prompt, 12, "ortgenai:fp32"), prompts))
        assert [(t.error, t.tokens, len(t.token_times)) for t in timings] == [(None, 12, 12)] * 3
        assert all(t.start < t.token_times[0] <= t.token_times[-1] <= t.end for t in timings)
        request = urllib.request.Request(f"http://{url}/generate", json.dumps({"input_ids": [1], "max_tokens": 64}).encode())
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=30)
        assert refused.value.code == 400 and "positions" in json.loads(refused.value.read())["error"]
        again = ortgenai_peer.ortgenai_request(url, prompts[0], 12, "ortgenai:fp32")
        assert again.error is None and again.tokens == 12
    finally:
        process.terminate()
        process.wait(timeout=30)
