"""One matrix over every registered policy: constructed eviction cases, promises kept, size constant.

A newly registered policy fails `test_every_policy_has_a_constructed_case` until it adds its
expected eviction to EXPECTED_EVICTIONS.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvpop.cache import SlotCache
from kvpop.model_spec import ModelSpec
from kvpop.policies import POLICIES, make_policy
from kvpop.policies.kvpop import AccumulatedAttentionScorer

SPEC = ModelSpec("LlamaForCausalLM", num_layers=1, num_attention_heads=4, num_kv_heads=2, head_dim=4,
                 vocab_size=16, dtype="float32", max_position_embeddings=4096)
OPTIONS = {"sinks": 1, "window": 2, "seed": 7}
BUDGET = 6

# How much attention every query of KV head h gives to the token at position p (both query heads of
# the group alike). Head 0: position 3 is weak. Head 1: position 0 is weakest overall, 5 is weak for
# the newest query, 4 (the token leaving kvpop's window when token 6 arrives) is weaker than 2.
IMPORTANCE = np.ones((2, 7), np.float32)
IMPORTANCE[0, 3] = 0.01
IMPORTANCE[1, [0, 2, 4, 5]] = [0.01, 0.5, 0.3, 0.005]

# Positions evicted per KV head when token 6 arrives in a full cache of 6 slots (0..5).
EXPECTED_EVICTIONS = {
    "full": (None, None),  # grows to 7 slots instead
    "streaming": (1, 1),  # oldest non-sink, attention ignored
    "h2o": (3, 0),  # lowest accumulated attention outside the window {5, 6}; no sinks
    "tova": (3, 5),  # lowest attention from the newest query; nothing protected
    "random": "seeded",  # checked for reproducibility instead
    "kvpop": (3, 4),  # head 0: a kept long-range token; head 1: the token leaving the window
    "keep_start": (4, 4),  # the latest token outside the window {5, 6}; attention ignored
    "snapkv": (0, 0),  # tokens that came one by one (no question to read): the oldest
}


def feed_constructed(cache: SlotCache, until: int) -> None:
    """Feed tokens one at a time, up to position `until` - 1, with attention from IMPORTANCE."""
    group = SPEC.query_heads_per_kv_head
    for position in range(cache.tokens_seen, until):
        held = cache.position[0]  # (Hkv, C) positions the new query can see
        attention = np.where(held >= 0, np.take_along_axis(IMPORTANCE, np.maximum(held, 0), axis=1), 0.0)
        attention = np.repeat(attention, group, axis=0)[None, :, None, :]  # (1, Hq, 1, C)
        chunk = np.repeat(IMPORTANCE[:, position], group)[None, :, None, None]  # (1, Hq, 1, 1)
        key = np.full((1, 2, 1, 4), position, np.float32)
        cache.append(key, key, attention.astype(np.float32), chunk.astype(np.float32))


def evicted(cache: SlotCache) -> list[set[int]]:
    return [set(range(cache.tokens_seen)) - set(cache.position[0, head, : cache.length].tolist()) for head in range(2)]


def new_cache(name: str, budget: int | None = BUDGET) -> SlotCache:
    return SlotCache(SPEC, make_policy(name, **OPTIONS), budget=None if name == "full" else budget)


def test_every_policy_has_a_constructed_case():
    assert set(EXPECTED_EVICTIONS) == set(POLICIES)


@pytest.mark.parametrize("name", list(POLICIES))
def test_constructed_eviction(name):
    cache = new_cache(name)
    feed_constructed(cache, 6)
    assert evicted(cache) == [set(), set()]
    feed_constructed(cache, 7)  # token 6 arrives in a full cache
    expected = EXPECTED_EVICTIONS[name]
    if expected == "seeded":
        again = new_cache(name)
        feed_constructed(again, 7)
        assert evicted(cache) == evicted(again) and all(len(head) == 1 for head in evicted(cache))
    else:
        assert evicted(cache) == [set() if position is None else {position} for position in expected]


@pytest.mark.parametrize("name", list(POLICIES))
@pytest.mark.parametrize("chunk", [1, 5])
def test_promises_hold_and_size_stays_constant(name, chunk):
    """Random attention, a long stream: size constant, sinks/window kept where the policy says so."""
    rng = np.random.default_rng(0)
    cache = new_cache(name, budget=8)
    policy = cache.policy
    sinks, window = policy.protected_counts(8)
    sizes = set()
    while cache.tokens_seen < 80:
        t, c = chunk, cache.capacity
        positions = np.arange(cache.tokens_seen, cache.tokens_seen + t, dtype=np.float32)
        key = np.broadcast_to(positions[None, None, :, None], (1, 2, t, 4)).copy()
        cache.append(key, key, rng.random((1, 4, t, c), dtype=np.float32), np.tril(rng.random((1, 4, t, t), dtype=np.float32)))
        held = [set(cache.position[0, head, : cache.length].tolist()) for head in range(2)]
        for head in range(2):
            np.testing.assert_array_equal(cache.key[0, head, : cache.length, 0], cache.position[0, head, : cache.length])
            assert set(range(min(sinks, cache.tokens_seen))) <= held[head], "a sink was evicted"
            assert set(range(max(cache.tokens_seen - window, 0), cache.tokens_seen)) <= held[head], "window evicted"
        if cache.tokens_seen >= 8:
            sizes.add((cache.length, cache.capacity, cache.nbytes))
    if policy.evicts:
        assert sizes == {(8, 8, 8 * SPEC.kv_bytes_per_token)}
        assert (sinks, window) == (1 if policy.uses_sinks else 0, 2 if policy.uses_window else 0)
    else:
        assert cache.length == cache.tokens_seen == 80


def test_streaming_keeps_exactly_sinks_and_the_most_recent():
    cache = new_cache("streaming")
    feed_constructed(cache, 7)
    for head in range(2):
        assert sorted(cache.position[0, head].tolist()) == [0, 2, 3, 4, 5, 6]


def test_unknown_policy_and_scorer_name_the_registered_ones():
    with pytest.raises(ValueError, match="registered: full, streaming"):
        make_policy("lru")
    with pytest.raises(ValueError, match="accumulated_attention"):
        make_policy("kvpop", scorer="lstm")
    with pytest.raises(ValueError, match="no learned kvpop scorer 'mlp'"):
        make_policy("kvpop", scorer="mlp")  # a learned kind: the model's assets have none


class _WindowedScorer(AccumulatedAttentionScorer):
    window = 16  # a learned scorer carries the window it was trained for


def test_a_learned_scorer_is_a_kvpop_only_option():
    """A service passes its kvpop scorer with every request: no other policy may change with it."""
    from kvpop.request import CacheConfig
    from kvpop.policies.kvpop.kinds import LEARNED_SCORER_KINDS
    from kvpop_train.scorer.network import KINDS

    assert KINDS is LEARNED_SCORER_KINDS  # one definition
    learned = {"mlstm": _WindowedScorer()}
    for policy in ("h2o", "tova", "streaming", "random"):
        config = CacheConfig(policy, budget=100, options=dict(scorer="mlstm"))
        built = config.build_policy({"kvpop": learned})
        assert getattr(built, "window", 64) == 64 and not hasattr(built, "scorer")
        assert config.build_policy({}) == built  # needs no learned scorer either
    kvpop = CacheConfig("kvpop", budget=100, options=dict(scorer="mlstm"))
    assert kvpop.build_policy({"kvpop": learned}).window == 16
    with pytest.raises(ValueError, match="no learned kvpop scorer 'mlstm'"):
        kvpop.build_policy({})


@pytest.mark.parametrize("name", list(POLICIES))
def test_observe_returns_its_decision_and_leaves_the_cache_alone(name):
    """The policy contract (kvpop.policies.base): `observe` only reads the cache and returns a
    StatisticsUpdate (every statistic for the new tokens, new values for changed cached slots), which
    the cache applies; `init_state` returns the state the cache keeps."""
    from kvpop.kvtypes import CacheUpdate
    from kvpop.kvtypes import StatisticsUpdate

    cache = new_cache(name)
    feed_constructed(cache, 6)  # kvpop: tokens 4 and 5 leave its window with the next two tokens
    arrays = {"key": cache.key, "value": cache.value, "position": cache.position, **cache.statistics}
    before = {label: array.copy() for label, array in arrays.items()}
    rng = np.random.default_rng(0)
    update = CacheUpdate(
        positions=np.arange(6, 8), key=rng.random((1, 2, 2, 4), np.float32), value=rng.random((1, 2, 2, 4), np.float32),
        attention=rng.random((1, 2, 2, 2, cache.capacity), np.float32), chunk_attention=rng.random((1, 2, 2, 2, 2), np.float32),
    )
    decided = cache.policy.observe(cache, update)
    assert isinstance(decided, StatisticsUpdate)
    for label, array in before.items():
        np.testing.assert_array_equal(arrays[label], array, err_msg=f"{name} wrote into the cache's {label}")
    assert set(decided.new) == set(cache.statistics) and set(decided.cached) <= set(cache.statistics)
    assert all(values.shape == (1, 2, 2) for values in decided.new.values())
    assert all(values.shape == (1, 2, cache.capacity) for values in decided.cached.values())
    assert not any(np.shares_memory(values, cache.statistics[stat]) for stat, values in decided.cached.items())
    assert type(cache.policy.init_state()) is type(new_cache(name).policy_state)


def test_kvpop_window_shrinks_to_a_quarter_of_a_tight_budget():
    """At 94% of a 2,048-token prompt (125 slots) a 64-token window would take half the budget: kvpop
    protects a quarter of it, never under `min_window` tokens and never more than its `window`."""
    from kvpop.policies.kvpop import KVpopPolicy

    policy = KVpopPolicy(sinks=4, window=64)
    assert policy.protected_counts(125) == (4, 32) and policy.long_range_slots(125) == 89
    assert policy.protected_counts(252) == (4, 63)
    assert policy.protected_counts(1000) == (4, 64)  # a loose budget keeps the whole window
    assert policy.protected_counts(40) == (4, 32)  # never under min_window ...
    assert policy.protected_counts(20) == (4, 16)  # ... unless the budget cannot hold it beside the sinks
    assert KVpopPolicy(sinks=4, window=16).protected_counts(125) == (4, 16)  # a smaller window stays
    assert KVpopPolicy(sinks=4, window=64, window_share=1.0).protected_counts(125) == (4, 64)
    for bad in ({"window_share": 0.0}, {"window_share": 1.5}, {"min_window": -1}):
        with pytest.raises(ValueError, match="window_share"):
            KVpopPolicy(**bad)


def test_kvpop_holds_the_shrunk_window_and_fills_the_rest_by_score():
    """A long stream at a tight budget: the last `window` tokens (the shrunk window) are always held, the
    sinks too, and the slots beyond them go to long-range tokens."""
    rng = np.random.default_rng(1)
    cache = SlotCache(SPEC, make_policy("kvpop", sinks=1, window=64), budget=40)
    sinks, window = cache.policy.protected_counts(40)
    assert (sinks, window) == (1, 32)
    while cache.tokens_seen < 160:
        c = cache.capacity
        key = np.full((1, 2, 1, 4), cache.tokens_seen, np.float32)
        cache.append(key, key, rng.random((1, 4, 1, c), dtype=np.float32), rng.random((1, 4, 1, 1), dtype=np.float32))
    for head in range(2):
        held = set(cache.position[0, head, : cache.length].tolist())
        assert len(held) == 40 and {0} | set(range(160 - window, 160)) <= held
        assert len([p for p in held if 0 < p < 160 - window]) == 40 - sinks - window  # long-range slots


def test_kvpop_recency_fill_keeps_the_newest_tokens_the_question_did_not_pick():
    """The ablation of the learned ranking: with no question to read, the long-range slots go to the newest tokens."""
    cache = SlotCache(SPEC, make_policy("kvpop", fill="recency", **OPTIONS), budget=BUDGET)
    feed_constructed(cache, 7)
    assert evicted(cache) == [{1}, {1}]  # sink 0 and window {5, 6} protected; of 1-4 the oldest goes


def test_snapkv_keeps_what_the_question_attends_to_with_its_neighbours():
    """A whole prompt with its question's attention: per KV head the tokens (and their +-3 neighbours) the last
    queries attend to most fill the budget beside the protected window."""
    from kvpop.policies.snapkv import SnapKVPolicy

    tokens, budget = 40, 12
    cache = SlotCache(SPEC, SnapKVPolicy(window=2), budget=budget)
    query = np.full((1, 4, 3, tokens), 1e-3, np.float32)  # (L, Hq, W, C + T): an empty cache, 40 prompt tokens
    query[:, :2, :, 10] = 1.0  # KV head 0 (query heads 0, 1) looks at position 10 ...
    query[:, 2:, :, 25] = 1.0  # ... KV head 1 at position 25
    key = np.zeros((1, 2, tokens, 4), np.float32)
    cache.append(key, key, None, None, query_attention=query)
    held = [set(cache.position[0, head].tolist()) for head in range(2)]
    assert set(range(7, 14)) | {38, 39} <= held[0] and set(range(22, 29)) | {38, 39} <= held[1]
