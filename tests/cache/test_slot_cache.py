"""The slot cache mechanics, on synthetic tensors (no model): writing, growing, evicting, pooling."""

from __future__ import annotations

import numpy as np
import pytest

from kvpop.cache import GROWTH_BLOCK, BatchSlotPool, SlotCache
from kvpop.model_spec import ModelSpec
from kvpop.policies import make_policy

SPEC = ModelSpec("LlamaForCausalLM", num_layers=2, num_attention_heads=4, num_kv_heads=2, head_dim=4,
                 vocab_size=16, dtype="float32", max_position_embeddings=4096)


def feed(cache: SlotCache, new_tokens: int, rng: np.random.Generator, capacity_seen: int | None = None) -> None:
    """Append `new_tokens` tokens whose key/value encode their position (so moves can be checked)."""
    L, Hkv, Hq, D = SPEC.num_layers, SPEC.num_kv_heads, SPEC.num_attention_heads, SPEC.head_dim
    positions = np.arange(cache.tokens_seen, cache.tokens_seen + new_tokens, dtype=np.float32)
    key = np.broadcast_to(positions[None, None, :, None], (L, Hkv, new_tokens, D)).copy()
    slots = capacity_seen if capacity_seen is not None else cache.capacity
    attention = rng.random((L, Hq, new_tokens, slots), dtype=np.float32)
    chunk = np.tril(rng.random((L, Hq, new_tokens, new_tokens), dtype=np.float32))
    cache.append(key, -key, attention, chunk)


def assert_consistent(cache: SlotCache) -> None:
    valid = cache.position[:, :, : cache.length]
    assert (valid >= 0).all() and (cache.position[:, :, cache.length :] == -1).all()
    np.testing.assert_array_equal(cache.key[:, :, : cache.length, 0], valid)  # keys moved with positions
    np.testing.assert_array_equal(cache.value[:, :, : cache.length, 0], -valid)
    for head_positions in valid.reshape(-1, cache.length):
        assert len(set(head_positions.tolist())) == cache.length  # no token stored twice in a head


def test_tokens_fill_the_prefix_and_storage_grows_in_blocks_up_to_the_budget():
    rng = np.random.default_rng(0)
    cache = SlotCache(SPEC, make_policy("streaming", sinks=2), budget=100)
    feed(cache, 5, rng)
    assert (cache.length, cache.capacity, cache.tokens_seen) == (5, GROWTH_BLOCK, 5)
    np.testing.assert_array_equal(cache.position[0, 0, :5], np.arange(5))
    feed(cache, GROWTH_BLOCK, rng)
    assert cache.capacity == 100  # capped at the budget, never beyond
    feed(cache, 50, rng)
    assert (cache.length, cache.capacity, cache.tokens_evicted) == (100, 100, 19)
    assert cache.nbytes == 2 * SPEC.num_layers * SPEC.num_kv_heads * 100 * SPEC.head_dim * 4
    assert_consistent(cache)


def test_full_cache_never_evicts():
    rng = np.random.default_rng(0)
    cache = SlotCache(SPEC, make_policy("full"), budget=None)
    for _ in range(10):
        feed(cache, 17, rng)
    assert cache.length == cache.tokens_seen == 170 and cache.tokens_evicted == 0
    np.testing.assert_array_equal(cache.position[1, 1, :170], np.arange(170))


@pytest.mark.parametrize("chunk", [1, 3, 7, 20])
def test_eviction_keeps_the_budget_with_chunks_shorter_and_longer_than_it(chunk):
    rng = np.random.default_rng(chunk)
    cache = SlotCache(SPEC, make_policy("h2o", window=2), budget=6)
    while cache.tokens_seen < 60:
        feed(cache, chunk, rng)
        assert cache.length == min(cache.tokens_seen, 6) and cache.capacity <= 6
        assert_consistent(cache)
    assert cache.peak_bytes == cache.nbytes


def test_heads_evict_independently():
    # Head 0's queries ignore position 1, head 1's ignore position 2: each head drops its own.
    cache = SlotCache(SPEC, make_policy("tova"), budget=3)
    L, Hq, D = SPEC.num_layers, SPEC.num_attention_heads, SPEC.head_dim
    for position in range(3):
        cache.append(np.full((L, 2, 1, D), position, np.float32), np.zeros((L, 2, 1, D), np.float32),
                     np.ones((L, Hq, 1, cache.capacity), np.float32), np.ones((L, Hq, 1, 1), np.float32))
    attention = np.ones((L, Hq, 1, cache.capacity), np.float32)
    attention[:, :2, 0, 1] = 0.0  # query heads 0-1 (KV head 0) on the slot of position 1
    attention[:, 2:, 0, 2] = 0.0  # query heads 2-3 (KV head 1) on the slot of position 2
    cache.append(np.full((L, 2, 1, D), 3, np.float32), np.zeros((L, 2, 1, D), np.float32), attention, np.ones((L, Hq, 1, 1), np.float32))
    assert sorted(cache.position[0, 0].tolist()) == [0, 2, 3]
    assert sorted(cache.position[0, 1].tolist()) == [0, 1, 3]


def test_pool_views_share_memory_and_repack_only_when_membership_changes():
    rng = np.random.default_rng(0)
    caches = [SlotCache(SPEC, make_policy("streaming", sinks=1), budget=budget) for budget in (8, 20, 8)]
    for cache, tokens in zip(caches, (30, 5, 12)):
        feed(cache, tokens, rng)
    pool = BatchSlotPool(SPEC)
    pool.bind(caches)
    assert pool.key.shape == (2, 3, 2, 20, 4) and pool.repacks == 1
    np.testing.assert_array_equal(pool.slot_mask(caches).sum(axis=1), [8, 5, 8])
    for row, cache in enumerate(caches):
        assert np.shares_memory(cache.key, pool.key)
        np.testing.assert_array_equal(pool.key[:, row, :, : cache.length], cache.key[:, :, : cache.length])
        feed(cache, 1, rng, capacity_seen=pool.slots)  # decode writes land in the pool in place
        assert_consistent(cache)
    pool.bind(caches)
    assert pool.repacks == 1  # nothing changed: no copy
    pool.bind(caches[:2])
    assert pool.repacks == 2 and pool.key.shape[1] == 2
    assert_consistent(caches[1])


def test_growing_caches_grow_in_place_in_the_pool_until_its_headroom_is_used():
    """Full caches crossing their growth blocks at different steps must not repack the pool each time."""
    rng = np.random.default_rng(0)
    caches = [SlotCache(SPEC, make_policy("full"), budget=None) for _ in range(3)]
    for cache, tokens in zip(caches, (GROWTH_BLOCK - 2, GROWTH_BLOCK - 1, 10)):
        feed(cache, tokens, rng)
    pool = BatchSlotPool(SPEC)
    pool.bind(caches)
    assert pool.slots > GROWTH_BLOCK and pool.repacks == 1  # room beyond the largest cache
    for _ in range(4):  # every cache crosses into its next growth block, one step apart
        for cache in caches:
            feed(cache, 1, rng, capacity_seen=pool.slots)
        pool.bind(caches)
    assert pool.repacks == 1  # grown in place: nothing copied
    for row, cache in enumerate(caches):
        assert cache.capacity > GROWTH_BLOCK or cache.length <= GROWTH_BLOCK
        assert np.shares_memory(cache.key, pool.key) and cache.storage_owner is pool
        np.testing.assert_array_equal(pool.key[:, row, :, : cache.length], cache.key[:, :, : cache.length])
        assert_consistent(cache)
    while caches[0].capacity <= pool.slots - GROWTH_BLOCK:  # use the headroom up: then it must move out
        feed(caches[0], GROWTH_BLOCK, rng)
    feed(caches[0], GROWTH_BLOCK, rng)
    assert caches[0].storage_owner is None and caches[0].capacity > pool.slots
    pool.bind(caches)
    assert pool.repacks == 2 and caches[0].storage_owner is pool
    assert_consistent(caches[0])


def test_a_cache_left_out_of_a_repack_grows_into_arrays_of_its_own():
    rng = np.random.default_rng(0)
    caches = [SlotCache(SPEC, make_policy("full"), budget=None) for _ in range(2)]
    for cache in caches:
        feed(cache, 10, rng)
    pool = BatchSlotPool(SPEC)
    pool.bind(caches)
    pool.bind(caches[:1])  # the second one is no longer bound, though its views still point into the old arrays
    feed(caches[1], pool.slots, rng)  # grows past a block
    assert caches[1].storage_owner is None and not np.shares_memory(caches[1].key, pool.key)
    assert_consistent(caches[1])
