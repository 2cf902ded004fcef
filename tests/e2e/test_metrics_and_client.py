"""The metrics port, and the client package and its command line against the same server."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvpop_client import KVpopServerError

pytestmark = pytest.mark.server

METRIC_NAMES = [
    "kvpop_kv_bytes_in_use", "kvpop_kv_bytes_reserved", "kvpop_kv_bytes_capacity", "kvpop_active_sequences",
    "kvpop_queued_sequences", "kvpop_prefilling_sequences", "kvpop_decoding_sequences", "kvpop_prompt_tokens_total",
    "kvpop_generated_tokens_total", "kvpop_evicted_tokens_total", "kvpop_requests_total", "kvpop_rejected_requests_total",
    "kvpop_compression_ratio_count", "kvpop_time_to_first_token_seconds_count",
    "kvpop_time_per_output_token_seconds_count", "kvpop_request_latency_seconds_count", "kvpop_batch_size_count",
]


def test_metrics_count_what_the_engine_did(kvpop_http, metrics):
    counted = [("kvpop_prompt_tokens_total", {}), ("kvpop_generated_tokens_total", {}),
               ("kvpop_evicted_tokens_total", {"policy": "tova"}), ("kvpop_request_latency_seconds_count", {})]
    before = [metrics(name, **labels) for name, labels in counted]
    result = kvpop_http.generate(list(range(5, 45)), max_tokens=6, eviction_policy="tova", kv_budget=16)
    after = [metrics(name, **labels) for name, labels in counted]
    assert set(METRIC_NAMES) <= {key.split("{")[0] for key in metrics()}
    assert [a - b for a, b in zip(after, before)] == [40, 6, result.tokens_evicted, 1]
    assert result.tokens_evicted > 0
    assert metrics("kvpop_kv_bytes_capacity") == 2**20


def test_client_validates_and_raises_server_errors(kvpop_grpc, kvpop_http):
    assert kvpop_grpc.is_ready() and kvpop_http.is_ready()
    result = kvpop_grpc.generate("Let a = 7.", max_tokens=5, stop=["\x00never"])
    assert result.finish_reason in ("length", "stop") and result.num_output_tokens == len(result.output_ids) <= 5
    with pytest.raises(KVpopServerError, match="unknown eviction policy"):
        kvpop_http.generate("Let a = 7.", eviction_policy="lru")
    with pytest.raises(TypeError, match="unknown option"):
        kvpop_http.generate("Let a = 7.", temprature=0.5)


def run_cli(*args):
    command = [sys.executable, "-m", "kvpop_client.cli", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


def test_cli_generate_stream_health_and_metrics(triton_server, kvpop_http):
    expected = kvpop_http.generate("Let a = 7.", max_tokens=6)
    complete = run_cli("--url", triton_server.http_url, "generate", "Let a = 7.", "--max-tokens", "6", "--json")
    assert complete.returncode == 0, complete.stderr
    assert json.loads(complete.stdout)["output_ids"] == expected.output_ids
    streamed = run_cli("--protocol", "grpc", "--url", triton_server.grpc_url, "generate", "Let a = 7.",
                       "--max-tokens", "6", "--stream", "--json")
    assert streamed.returncode == 0, streamed.stderr
    assert json.loads(streamed.stdout)["output_ids"] == expected.output_ids
    assert run_cli("--url", triton_server.http_url, "health").stdout.strip() == "ready"
    metrics = run_cli("--url", triton_server.http_url, "metrics", "--metrics-url", triton_server.metrics_url)
    assert "kvpop_kv_bytes_capacity" in metrics.stdout
    failed = run_cli("--url", triton_server.http_url, "generate", "Let a = 7.", "--policy", "lru")
    assert failed.returncode == 1 and "unknown eviction policy" in failed.stderr
