"""Warm prefixes through the engine on the tiny exported model: a request that starts with a warm
prefix begins from a copy of its prefilled cache and gives what a cold prefill gives; for `full` the
whole prefix is reused, for a bounded policy the chunk-aligned part, where the cache state equals a
cold prefill's; snapshots are never changed by the requests that use them."""

from __future__ import annotations

import numpy as np
import pytest

from kvpop.cache.prefix_cache import PrefixCache
from kvpop.engine import Engine, EngineConfig
from kvpop.policies.kvpop import load_learned_scorers
from kvpop.request import CacheConfig, GenerationRequest, SamplingParams

CHUNK = 8
REPLY = 10


@pytest.fixture(scope="module")
def scorers(tiny_onnx_model_dir):
    return load_learned_scorers(tiny_onnx_model_dir)


def tokens(seed: int, count: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 250, count).tolist()


PREFIX = tokens(1, 44)  # 5.5 chunks of 8


def request(request_id: str, prompt: list[int], cache: CacheConfig) -> GenerationRequest:
    return GenerationRequest(request_id, prompt, SamplingParams(max_tokens=REPLY, ignore_eos=True), cache)


def engines(decoder, scorers, cache: CacheConfig) -> tuple[Engine, Engine, int]:
    """(an engine with PREFIX warm, a cold one, the prefix tokens kept)."""
    warm = Engine(decoder, EngineConfig(prefill_chunk=CHUNK), policy_assets={"kvpop": scorers}, prefixes=PrefixCache())
    kept = warm.warm_prefix(PREFIX, cache)
    return warm, Engine(decoder, EngineConfig(prefill_chunk=CHUNK), policy_assets={"kvpop": scorers}), kept


def test_full_reuses_the_whole_prefix_and_gives_the_cold_tokens(decoder, scorers):
    warm, cold, kept = engines(decoder, scorers, CacheConfig())
    assert kept == len(PREFIX)  # not a whole number of chunks: full keeps it all
    prompts = [PREFIX + tokens(10 + i, 3 + 5 * i) for i in range(3)]
    reused = warm.generate([request(f"w{i}", prompt, CacheConfig()) for i, prompt in enumerate(prompts)])
    reference = cold.generate([request(f"c{i}", prompt, CacheConfig()) for i, prompt in enumerate(prompts)])
    assert [r.output_ids for r in reused] == [r.output_ids for r in reference]
    for result in reused:
        assert result.prefix_lookup and result.tokens_reused == result.prefix_tokens_reused == len(PREFIX)
    assert all(not r.prefix_lookup and r.tokens_reused == 0 for r in reference)  # no warm prefixes: no lookup


def test_a_prompt_without_the_prefix_or_with_nothing_after_it_misses(decoder, scorers):
    warm, _, _ = engines(decoder, scorers, CacheConfig())
    other, exact, edited = tokens(5, 50), list(PREFIX), [PREFIX[0] + 1, *PREFIX[1:], 7]
    results = warm.generate([request(f"m{i}", prompt, CacheConfig()) for i, prompt in enumerate([other, exact, edited])])
    assert all(r.prefix_lookup and r.tokens_reused == 0 for r in results)
    bounded = warm.generate([request("b", PREFIX + [7], CacheConfig(policy="streaming", budget=24))])[0]
    assert bounded.prefix_lookup and bounded.tokens_reused == 0  # another configuration's snapshot


@pytest.mark.parametrize("policy", ["streaming", "h2o", "tova", "random", "kvpop", "kvpop:mlstm"])
def test_a_bounded_prefix_is_chunk_aligned_and_equals_a_cold_prefill(decoder, scorers, policy):
    name, _, scorer = policy.partition(":")
    cache = CacheConfig(policy=name, budget=24, options=dict(sinks=2, window=4, seed=7, scorer=scorer or "accumulated_attention"))
    warm, cold, kept = engines(decoder, scorers, cache)
    assert kept == 40  # 5 whole chunks; the prefix is longer than the budget, so it already evicted
    prompt = PREFIX + tokens(20, 13)
    # The cache after the whole prompt (and the first token's logits): the same state, the same evictions.
    mine, theirs = warm.prefill(request("p", prompt, cache)), cold.prefill(request("p", prompt, cache))
    assert mine.allocation.prefix_tokens_reused == kept and theirs.allocation.prefix_tokens_reused == 0
    assert mine.cache.tokens_seen == theirs.cache.tokens_seen and mine.next_token == theirs.next_token
    np.testing.assert_array_equal(mine.cache.position, theirs.cache.position)
    np.testing.assert_allclose(mine.cache.key, theirs.cache.key, rtol=0, atol=1e-6)
    for stat in theirs.cache.statistics:
        np.testing.assert_allclose(mine.cache.statistics[stat], theirs.cache.statistics[stat], rtol=1e-5, atol=1e-6)
    reused = warm.generate([request("w", prompt, cache)])[0]
    assert reused.output_ids == cold.generate([request("c", prompt, cache)])[0].output_ids
    assert reused.tokens_reused == kept and reused.tokens_evicted > 0


def test_requests_start_from_copies_and_never_change_the_snapshot(decoder, scorers):
    cache = CacheConfig(policy="h2o", budget=24, options=dict(window=4))
    warm, cold, _ = engines(decoder, scorers, cache)
    [snapshot] = warm.cache_manager.prefixes
    before = {name: np.array(getattr(snapshot, name)) for name in ("key", "value", "position")}
    before_stats = {name: stat.copy() for name, stat in snapshot.statistics.items()}
    prompts = [PREFIX + tokens(30 + i, 9) for i in range(4)]
    batched = warm.generate([request(f"w{i}", prompt, cache) for i, prompt in enumerate(prompts)])  # one batch
    again = warm.generate([request(f"a{i}", prompt, cache) for i, prompt in enumerate(prompts)])
    reference = cold.generate([request(f"c{i}", prompt, cache) for i, prompt in enumerate(prompts)])
    assert [r.output_ids for r in batched] == [r.output_ids for r in again] == [r.output_ids for r in reference]
    for name, array in before.items():
        np.testing.assert_array_equal(getattr(snapshot, name), array)
    for name, stat in before_stats.items():
        np.testing.assert_array_equal(snapshot.statistics[name], stat)


def test_a_compression_ratio_has_no_fixed_budget_to_warm(decoder, scorers):
    engine = Engine(decoder, EngineConfig(prefill_chunk=CHUNK))
    with pytest.raises(ValueError, match="fixed budget"):
        engine.warm_prefix(PREFIX, CacheConfig(policy="h2o", compression=0.5))
    assert engine.warm_prefix(PREFIX[:5], CacheConfig(policy="h2o", budget=24)) == 0  # not one whole chunk
    assert len(engine.cache_manager.prefixes) == 0


def test_the_warm_prefixes_parameter_is_validated_at_load():
    from kvpop.serving.kvpop_engine.config import ServiceConfig
    from kvpop.serving.kvpop_engine.warm_prefixes import parse_warm_prefixes, warm_policies

    system = [{"role": "system", "content": "Be brief."}]
    assert parse_warm_prefixes('["You are helpful.", [{"role": "system", "content": "Be brief."}]]') == ["You are helpful.", system]
    assert parse_warm_prefixes("") == [] and warm_policies("full", " h2o, full,kvpop ") == ["full", "h2o", "kvpop"]
    for text, message in [("[1]", r"warm_prefixes\[0\]"), ("{", "not valid JSON"), ('"x"', "JSON list"), ('[""]', "non-empty")]:
        with pytest.raises(ValueError, match=message):
            ServiceConfig(warm_prefixes=text)
    with pytest.raises(ValueError, match="unknown policies"):
        ServiceConfig(warm_prefixes='["x"]', warm_prefix_policies="h2o,lru")
