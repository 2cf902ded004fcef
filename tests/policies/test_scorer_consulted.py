"""The kvpop policy consults its learned scorer only when a score can decide an eviction.

Two cases leave the scorer out, and neither may change a decision:
- no long-range slot (budget = sinks + window): every token leaving the window is dropped, as
  StreamingLLM drops it;
- a cache that has never had to evict: a scorer that reads keys and values only takes the cache's
  history in at once when the cache first evicts (`KVpopPolicy._scorer_behind`). Its decisions must be
  those of a scorer that took every token in as it came (`KeepingPace` below), whichever path the
  first eviction takes: a decode step, a whole prompt chunk, or a chunk cut in pieces.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvpop.decoder import DecoderStep
from kvpop.engine import Engine, EngineConfig
from kvpop.policies.kvpop import load_learned_scorers
from kvpop.request import CacheConfig, GenerationRequest, SamplingParams
from kvpop.policies.kvpop import SCORE
from kvpop.policies.kvpop.runtime import LearnedScorer

rng = np.random.default_rng(11)
PROMPT = [0] + [int(token) for token in rng.integers(3, 250, size=47)]  # 48 tokens
RUNNING_PROMPTS = [[0, 5, 17, 99, 23], [0, 250, 3]]


class KeepingPace(LearnedScorer):
    """The same network, taking every token in as it arrives (the behaviour before deferral)."""

    catches_up = False


@pytest.fixture(scope="module")
def scorers(tiny_onnx_model_dir):
    return load_learned_scorers(tiny_onnx_model_dir)


@pytest.fixture(scope="module")
def decoder(tiny_onnx_model_dir):
    return DecoderStep(tiny_onnx_model_dir, threads=1)


def count_scorer_calls(scorer: LearnedScorer, monkeypatch) -> list[str]:
    calls: list[str] = []
    runtime = scorer.runtime
    for name in ("step", "step_decode_batch"):
        original = getattr(runtime, name)
        monkeypatch.setattr(runtime, name, lambda *args, _name=name, _original=original, **kwargs: (calls.append(_name), _original(*args, **kwargs))[1])
    return calls


def run(engine: Engine, requests: list[GenerationRequest], watch: str) -> tuple[list[int], np.ndarray, np.ndarray]:
    """Run to completion; the watched request's output and its cache's positions and kvpop scores
    (empty for another policy) after its last decode step."""
    for request in requests:
        engine.add_request(request)
    last = None
    while engine.has_unfinished():
        sequence = engine.sequence(watch) if watch in engine.state().decoding else None
        if sequence is not None:
            last = (sequence.cache.position.copy(), sequence.cache.statistics.get(SCORE, np.zeros(0)).copy())
        engine.step()
    return engine.result(watch).output_ids, *last


def request(name: str, prompt: list[int], max_tokens: int, config: CacheConfig) -> GenerationRequest:
    return GenerationRequest(name, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), config)


@pytest.mark.parametrize("kind", ["mlstm", "mlp"])
def test_a_cache_that_never_evicts_never_runs_the_scorer(decoder, scorers, kind, monkeypatch):
    calls = count_scorer_calls(scorers[kind], monkeypatch)
    config = CacheConfig(policy="kvpop", budget=64, options=dict(sinks=2, scorer=kind))  # 48 + 12 tokens fit
    output, position, score = run(Engine(decoder, EngineConfig(prefill_chunk=16), policy_assets={"kvpop": scorers}), [request("a", PROMPT, 12, config)], "a")
    full = Engine(decoder, EngineConfig(prefill_chunk=16)).generate([request("f", PROMPT, 12, CacheConfig(policy="full"))])[0]
    assert calls == []
    assert output == full.output_ids
    assert not score.any()


@pytest.mark.parametrize("kind", ["mlstm", "mlp"])
def test_no_long_range_slot_means_streaming_and_no_scorer_call(decoder, scorers, kind, monkeypatch):
    window = scorers[kind].window
    calls = count_scorer_calls(scorers[kind], monkeypatch)
    budget = 2 + window  # sinks + the scorer's window: nothing is kept by score
    kvpop = run(Engine(decoder, EngineConfig(prefill_chunk=16), policy_assets={"kvpop": scorers}),
                [request("k", PROMPT, 20, CacheConfig(policy="kvpop", budget=budget, options=dict(sinks=2, scorer=kind)))], "k")
    streaming = run(Engine(decoder, EngineConfig(prefill_chunk=16)),
                    [request("s", PROMPT, 20, CacheConfig(policy="streaming", budget=budget, options=dict(sinks=2)))], "s")
    assert calls == []
    assert kvpop[0] == streaming[0]
    np.testing.assert_array_equal(kvpop[1], streaming[1])


# Where the cache first evicts: in a decode step (the prompt fits the budget); in the second whole
# chunk (the first fills the budget exactly); in a chunk cut in pieces beside two running streams.
FIRST_EVICTION = {
    "decode": dict(budget=56, prefill_chunk=16, max_step_tokens=None, running=False),
    "chunk": dict(budget=16, prefill_chunk=16, max_step_tokens=None, running=False),
    "pieces": dict(budget=24, prefill_chunk=24, max_step_tokens=5, running=True),
}


@pytest.mark.parametrize("kind", ["mlstm", "mlp"])
@pytest.mark.parametrize("where", list(FIRST_EVICTION))
def test_a_scorer_catching_up_decides_as_one_that_kept_pace(decoder, scorers, kind, where):
    case = FIRST_EVICTION[where]
    config = CacheConfig(policy="kvpop", budget=case["budget"], options=dict(sinks=2, scorer=kind))

    def outcome(learned_scorers):
        engine = Engine(decoder, EngineConfig(max_batch_size=4, prefill_chunk=case["prefill_chunk"], max_step_tokens=case["max_step_tokens"]), policy_assets={"kvpop": learned_scorers})
        running = [request(f"s{i}", prompt, 40, config) for i, prompt in enumerate(RUNNING_PROMPTS)] if case["running"] else []
        for stream in running:
            engine.add_request(stream)
        if running:
            engine.step()  # the streams decode before the long prompt arrives
        return run(engine, [request("long", PROMPT, 24, config)], "long")

    deferred = outcome(scorers)
    kept_pace = outcome({name: KeepingPace(scorer.runtime) for name, scorer in scorers.items()})
    assert deferred[0] == kept_pace[0]
    np.testing.assert_array_equal(deferred[1], kept_pace[1])
    np.testing.assert_allclose(deferred[2], kept_pace[2], atol=1e-4)
    assert deferred[2].any()  # the long-range slots were decided by real scores
