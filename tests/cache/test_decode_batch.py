"""The vectorised decode path (kvpop.policies.kvpop.decode_batch) decides exactly what the per-sequence path does."""

from __future__ import annotations

import numpy as np
import pytest

from kvpop.policies.kvpop import decode_batch
from kvpop.engine import Engine, EngineConfig
from kvpop.request import CacheConfig, GenerationRequest, SamplingParams
from kvpop.policies.kvpop import SCORE


def batch(tag: str) -> list[GenerationRequest]:
    """Learned-scorer sequences of different lengths and budgets, sharing the batch with other policies."""
    rng = np.random.default_rng(7)
    configs = [
        CacheConfig(policy="kvpop", budget=12, options=dict(sinks=2, scorer="mlstm")),
        CacheConfig(policy="kvpop", budget=12, options=dict(sinks=2, scorer="mlstm")),
        CacheConfig(policy="kvpop", budget=20, options=dict(sinks=1, scorer="mlstm")),
        CacheConfig(policy="kvpop", budget=12, options=dict(sinks=2, scorer="mlp")),
        CacheConfig(policy="kvpop", budget=16, options=dict(sinks=3, scorer="mlp")),
        CacheConfig(policy="h2o", budget=12, options=dict(sinks=2, window=4)),
        CacheConfig(policy="full"),
    ]
    return [
        GenerationRequest(f"{tag}{i}", rng.integers(3, 200, size=int(rng.integers(20, 60))).tolist(),
                          SamplingParams(max_tokens=24, ignore_eos=True), config)
        for i, config in enumerate(configs)
    ]


def snapshot(engine: Engine) -> dict[str, tuple]:
    """Every running sequence's cache contents, by request id (without the tag)."""
    return {
        request_id[1:]: (sequence.cache.tokens_seen, sequence.cache.position.copy(), np.array(sequence.cache.key),
                         {name: stat.copy() for name, stat in sequence.cache.statistics.items()})
        for request_id, sequence in ((name, engine.sequence(name)) for name in engine.state().decoding)
    }


def test_vectorised_decode_equals_the_per_sequence_path_step_by_step(tiny_onnx_model_dir, monkeypatch):
    vectorised = Engine.from_model_dir(tiny_onnx_model_dir, EngineConfig(prefill_chunk=8))
    per_sequence = Engine.from_model_dir(tiny_onnx_model_dir, EngineConfig(prefill_chunk=8))
    per_sequence.cache_manager.batch_decode = False
    grouped = []
    original = decode_batch._append_group
    monkeypatch.setattr(decode_batch, "_append_group", lambda caches, *rest: (grouped.append(len(caches)), original(caches, *rest))[1])

    for request in batch("v"):
        vectorised.add_request(request)
    for request in batch("p"):
        per_sequence.add_request(request)
    steps = 0
    while vectorised.has_unfinished() or per_sequence.has_unfinished():
        events_v, events_p = vectorised.step(), per_sequence.step()
        assert [(e.request_id[1:], e.token_id) for e in events_v] == [(e.request_id[1:], e.token_id) for e in events_p]
        state_v, state_p = snapshot(vectorised), snapshot(per_sequence)
        assert state_v.keys() == state_p.keys()
        for request_id, (seen, position, key, statistics) in state_v.items():
            seen_p, position_p, key_p, statistics_p = state_p[request_id]
            assert seen == seen_p and np.array_equal(position, position_p) and np.array_equal(key, key_p)
            assert statistics.keys() == statistics_p.keys()
            for name in statistics:  # scores: the decode graph's and the chunk graph's arithmetic (folded weights)
                np.testing.assert_allclose(statistics[name], statistics_p[name], atol=1e-5, err_msg=f"{request_id} {name} {steps}")
        steps += 1
    # The learned-scorer sequences did go through the vectorised path, several at a time.
    assert grouped and max(grouped) >= 2
    assert [vectorised.result(f"v{i}").output_ids for i in range(7)] == [per_sequence.result(f"p{i}").output_ids for i in range(7)]


@pytest.mark.parametrize("kind", ["mlstm", "mlp"])
def test_only_steady_state_kvpop_caches_are_grouped(tiny_onnx_model_dir, kind):
    engine = Engine.from_model_dir(tiny_onnx_model_dir, EngineConfig(prefill_chunk=8))
    config = CacheConfig(policy="kvpop", budget=12, options=dict(sinks=2, scorer=kind))
    def allocate(request: GenerationRequest):  # a request as the engine reads it, given its cache
        return engine.cache_manager.allocate(request, engine.read(request).plan).cache

    cache = allocate(GenerationRequest("a", list(range(3, 40)), SamplingParams(max_tokens=4), config))
    assert cache.policy.decode_group(cache) is None  # empty: still filling up
    other = allocate(GenerationRequest("b", [3, 4, 5], SamplingParams(max_tokens=4), CacheConfig(policy="streaming", budget=8)))
    assert other.policy.decode_group(other) is None  # not kvpop
    assert SCORE in cache.statistics
