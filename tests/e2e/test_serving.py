"""Serving behaviour: policies, sampling, in-flight batching, admission, cancellation, metrics."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvpop.policies import POLICIES
from kvpop_client import KVpopClient, KVpopServerError

pytestmark = pytest.mark.server
LONG_PROMPT = list(range(5, 45))  # 40 tokens


def wait_for(predicate, timeout: float = 15.0) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


@pytest.mark.parametrize("policy", list(POLICIES))
def test_every_policy_bounds_the_cache(kvpop_grpc, policy):
    bounded = policy != "full"
    options = {"eviction_policy": policy, "kv_budget": 16 if bounded else None}
    result = kvpop_grpc.generate(LONG_PROMPT, max_tokens=10, **options)
    assert result.num_output_tokens == len(result.output_ids) > 0
    seen = len(LONG_PROMPT) + result.num_output_tokens - 1  # the last token is never fed back
    if bounded:
        assert result.kv_budget == 16
        assert result.tokens_evicted == seen - 16
        assert result.compression == pytest.approx(1 - 16 / seen, abs=1e-6)
    else:
        assert result.tokens_evicted == 0 and result.compression == 0.0


@pytest.mark.parametrize("policy", [name for name in POLICIES if name != "full"])
def test_a_budget_larger_than_the_sequence_changes_nothing(kvpop_grpc, policy):
    full = kvpop_grpc.generate(LONG_PROMPT, max_tokens=10)
    roomy = kvpop_grpc.generate(LONG_PROMPT, max_tokens=10, eviction_policy=policy, kv_budget=256)
    assert roomy.output_ids == full.output_ids and roomy.tokens_evicted == 0


def test_compression_ratio_sets_the_budget(kvpop_http):
    result = kvpop_http.generate(LONG_PROMPT, max_tokens=10, eviction_policy="streaming", compression_ratio=0.5)
    assert result.kv_budget == 25  # ceil(0.5 * (40 + 10))


def test_seeded_sampling_is_reproducible(kvpop_http, kvpop_grpc):
    sampled = dict(max_tokens=16, temperature=1.0, top_p=0.95, top_k=50)
    first = kvpop_http.generate("Let a = 7.", seed=1234, **sampled)
    again = kvpop_grpc.generate("Let a = 7.", seed=1234, **sampled)
    other = kvpop_http.generate("Let a = 7.", seed=99, **sampled)
    assert first.output_ids == again.output_ids
    assert other.output_ids != first.output_ids


def test_concurrent_requests_are_decoded_together(kvpop_grpc, metrics):
    steps_before = metrics("kvpop_batch_size_count")
    sequences_before = metrics("kvpop_batch_size_sum")
    prompts = [[5 + index, 17, 45, 99, 120, 7] for index in range(8)]
    alone = [kvpop_grpc.generate(prompt, max_tokens=24).output_ids for prompt in prompts]
    steps_alone = metrics("kvpop_batch_size_count") - steps_before
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda prompt: kvpop_grpc.generate(prompt, max_tokens=24).output_ids, prompts))
    assert together == alone  # batching does not change greedy output
    steps_together = metrics("kvpop_batch_size_count") - steps_before - steps_alone
    sequences = metrics("kvpop_batch_size_sum") - sequences_before
    assert steps_together < steps_alone / 2  # decoded together, not one after another
    assert sequences == sum(map(len, alone)) + sum(map(len, together))  # each generated token once


def test_cancelling_a_stream_frees_its_slots_within_a_step(kvpop_grpc, metrics):
    cancelled_before = metrics("kvpop_requests_total", finish_reason="cancelled")
    stream, _ = hold_kv_memory(kvpop_grpc, kv_budget=512)
    next(stream)
    assert metrics("kvpop_active_sequences") == 1
    assert metrics("kvpop_kv_bytes_reserved") > 0
    stream.close()  # stops the gRPC stream with cancel_requests=True
    assert wait_for(lambda: metrics("kvpop_active_sequences") == 0 and metrics("kvpop_kv_bytes_reserved") == 0)
    assert wait_for(lambda: metrics("kvpop_requests_total", finish_reason="cancelled") == cancelled_before + 1)


def test_a_disconnected_sse_client_frees_its_slots(kvpop_http, metrics):
    stream, _ = hold_kv_memory(kvpop_http, kv_budget=256)  # generate_stream over HTTP
    next(stream)
    assert metrics("kvpop_active_sequences") == 1
    stream.close()  # drops the HTTP connection
    assert wait_for(lambda: metrics("kvpop_active_sequences") == 0 and metrics("kvpop_kv_bytes_reserved") == 0)


def hold_kv_memory(client, kv_budget: int):
    """Start a stream that runs for a minute unless cancelled; return it once it holds its slots.

    The tiny model decodes ~1000 tokens a second, so only a long, bounded stream outlives a test's checks.
    """
    prompt = LONG_PROMPT if client.protocol == "grpc" else "Let a = 7. " * 8  # SSE takes text
    stream = client.stream(prompt, max_tokens=60_000, ignore_eos=True, eviction_policy="streaming", kv_budget=kv_budget)
    return stream, next(stream)


def test_overload_is_rejected_clearly_and_queued_requests_complete(triton_server, kvpop_grpc, metrics):
    stream, _ = hold_kv_memory(kvpop_grpc, kv_budget=1100)  # 1152 of 2048 slots: no 1088-slot request fits
    rejected_before = metrics("kvpop_rejected_requests_total", reason="overloaded")
    outcomes = []

    def big_request(protocol):  # through kvpop_service: its queue is the engine's, nothing hides
        url = triton_server.http_url if protocol == "http" else triton_server.grpc_url
        with KVpopClient(url, protocol) as client:  # HTTP clients are per thread
            try:
                outcomes.append(client.generate(LONG_PROMPT, max_tokens=1000))
            except KVpopServerError as error:
                outcomes.append(error)

    threads = [threading.Thread(target=big_request, args=(("http", "grpc")[index % 2],)) for index in range(6)]
    for thread in threads:
        thread.start()
    assert wait_for(lambda: len(outcomes) >= 4)  # 2 wait in the queue (max_queue_size 2), 4 are refused
    refused = [outcome for outcome in outcomes if isinstance(outcome, KVpopServerError)]
    assert len(refused) == 4 and all("overloaded" in str(error) for error in refused)
    assert {error.status for error in refused} <= {"503", "StatusCode.UNAVAILABLE"}  # retryable, never 500
    assert metrics("kvpop_queued_sequences") == 2
    stream.close()  # frees the pool: the queued requests now run to completion
    for thread in threads:
        thread.join(120)
    completed = [outcome for outcome in outcomes if not isinstance(outcome, KVpopServerError)]
    assert len(completed) == 2 and all(result.num_output_tokens > 0 for result in completed)
    assert metrics("kvpop_rejected_requests_total", reason="overloaded") == rejected_before + 4


def test_tight_pool_degrades_the_budget_down_to_the_floor(kvpop_grpc):
    stream, _ = hold_kv_memory(kvpop_grpc, kv_budget=512)
    try:
        # Needs min(1500, 40 + 1500) slots per head: more than the 2048-slot pool has beside the holder.
        result = kvpop_grpc.generate(LONG_PROMPT, max_tokens=1500, eviction_policy="kvpop", kv_budget=1500)
    finally:
        stream.close()
    # 2 sequences x 1024 slots would fill the 2048-slot pool exactly; kvpop (a learned scorer) prefills its
    # prompt whole and holds it beside the pool until its first token, so it gets one growth block less.
    assert result.kv_budget == 1024 - 64


def test_memory_stays_within_the_kv_pool_under_many_streams(kvpop_grpc, metrics):
    capacity = metrics("kvpop_kv_bytes_capacity")
    peak, done = [0.0], threading.Event()

    def sample():  # back to back: on a fast machine the streams are over in well under a second
        while not done.is_set():
            peak[0] = max(peak[0], metrics("kvpop_kv_bytes_in_use"), metrics("kvpop_kv_bytes_reserved"))

    def stream(index):
        # More streams than the 2-deep queue may wait: a refusal is back-pressure (503), so retry.
        for _ in range(200):
            try:
                return [chunk for chunk in kvpop_grpc.stream([5 + index, *LONG_PROMPT], max_tokens=256,
                                                             eviction_policy="h2o", kv_budget=128)][-1].result
            except KVpopServerError as error:
                assert error.status == "UNAVAILABLE", error
                time.sleep(0.05)
        raise AssertionError("never admitted")

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        with ThreadPoolExecutor(12) as pool:
            results = list(pool.map(stream, range(12)))
    finally:
        done.set()
        sampler.join()
    assert all(result.finish_reason in ("length", "stop") for result in results)
    assert 0 < peak[0] <= capacity


def test_a_cancelled_complete_answer_request_frees_its_slots(triton_server, metrics):
    """kvpop_service forwards through BLS, which cannot be cancelled: it tells the engine instead."""
    import numpy as np
    import tritonclient.grpc as grpcclient

    cancelled_before = metrics("kvpop_requests_total", finish_reason="cancelled")
    with grpcclient.InferenceServerClient(triton_server.grpc_url) as client:
        inputs = []
        for name, value, datatype in [("input_ids", [LONG_PROMPT], "INT32"), ("max_tokens", [[60_000]], "INT32"),
                                      ("ignore_eos", [[True]], "BOOL"), ("eviction_policy", [[b"streaming"]], "BYTES"),
                                      ("kv_budget", [[256]], "INT32")]:
            array = np.array(value, dtype=np.object_ if datatype == "BYTES" else {"INT64": np.int64, "INT32": np.int32, "BOOL": bool}[datatype])
            inputs.append(grpcclient.InferInput(name, list(array.shape), datatype))
            inputs[-1].set_data_from_numpy(array)
        call = client.async_infer("kvpop_service", inputs, callback=lambda result, error: None)
        assert wait_for(lambda: metrics("kvpop_active_sequences") == 1)
        call.cancel()
        assert wait_for(lambda: metrics("kvpop_active_sequences") == 0 and metrics("kvpop_kv_bytes_reserved") == 0)
    assert wait_for(lambda: metrics("kvpop_requests_total", finish_reason="cancelled") == cancelled_before + 1)
