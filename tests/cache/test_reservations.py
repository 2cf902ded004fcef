"""The cache manager owns the instance's KV memory: reservations made at admission, sized by the
manager, accounted beside what the engine really holds, and kept across an engine restart."""

from __future__ import annotations

from kvpop.cache.manager import CacheManager
from kvpop.cache.reservations import KVReservations, Reservation, storage_slots
from kvpop.engine import Engine, EngineConfig
from kvpop.model_spec import ModelSpec
from kvpop.request import CacheConfig, GenerationRequest, SamplingParams

SPEC = ModelSpec("LlamaForCausalLM", num_layers=2, num_attention_heads=4, num_kv_heads=2, head_dim=16,
                 vocab_size=320, dtype="float32", max_position_embeddings=4096)  # 512 bytes per slot


def request(request_id: str, budget: int | None = 128, prompt: int = 40, max_tokens: int = 200) -> GenerationRequest:
    config = CacheConfig("streaming", budget=budget) if budget else CacheConfig()
    return GenerationRequest(request_id, list(range(3, 3 + prompt)), SamplingParams(max_tokens=max_tokens), config)


def manager(slots: int | None) -> CacheManager:
    return CacheManager(SPEC, reservations=KVReservations(slots and slots * SPEC.kv_bytes_per_token, SPEC))


def test_a_reservation_is_granted_while_it_fits_and_released_at_the_end():
    cache = manager(slots=256)
    assert cache.reserve("a", 128) == Reservation("a", slots=128)
    assert cache.reserved_bytes == 128 * 512
    assert cache.reserve("b", 256) is None  # 2 rows padded to 256 slots: over the pool
    assert cache.reserved_bytes == 128 * 512  # a refused reservation holds nothing
    assert cache.reserve("b", 128) == Reservation("b", slots=128)  # at a smaller budget
    cache.release("a"), cache.release("b"), cache.release("never-reserved")
    assert cache.reserved_bytes == 0


def test_storage_is_sized_in_whole_growth_blocks_at_most_what_the_request_can_see():
    assert storage_slots(100, prompt_tokens=40, max_tokens=200) == 128
    assert storage_slots(None, prompt_tokens=100, max_tokens=100) == 256  # full: prompt + output
    assert storage_slots(1000, prompt_tokens=10, max_tokens=10) == 64  # never more than it sees
    assert manager(slots=None).reserve("d", storage_slots(None, 40, 100_000)) is not None  # no pool limit given: no limit


def test_a_whole_prompt_prefill_holds_its_prompt_until_the_first_token():
    cache = manager(slots=2048)
    cache.reserve("a", 128, prefill_slots=900)
    assert cache.reserved_bytes == (128 + 900) * 512
    cache.prefill_done("a")
    assert cache.reserved_bytes == 128 * 512


def test_what_a_prefill_holds_is_the_schedulers_whole_prompt_decision(decoder):
    whole = Engine(decoder, EngineConfig(prefill_chunk=8, whole_prompt_tokens=64))
    assert whole.read(request("short", budget=16, prompt=40)).plan.prefill_slots == 40
    assert whole.read(request("long", budget=16, prompt=100)).plan.prefill_slots == 0  # evicts while prefilling
    assert whole.read(request("full", budget=None, prompt=40)).plan.prefill_slots == 0  # a full cache holds its prompt anyway
    assert Engine(decoder, EngineConfig(prefill_chunk=8)).read(request("never-whole", budget=16)).plan.prefill_slots == 0


def test_the_ledger_outlives_an_engine_and_sees_what_the_engine_holds(decoder):
    pool = KVReservations(4096 * decoder.spec.kv_bytes_per_token, decoder.spec)
    first = Engine(decoder, EngineConfig(prefill_chunk=8), reservations=pool)
    first.add_request(request("a", budget=None, prompt=20, max_tokens=8))  # reserved at once: the pool is empty
    restarted = Engine(decoder, EngineConfig(prefill_chunk=8), reservations=pool)  # after a failure
    assert restarted.cache_manager.reserved_bytes == 64 * decoder.spec.kv_bytes_per_token
    first.scheduler.waiting.remove({"a"})  # the first engine failed: what waited in it leaves its reservation ...
    assert pool.reserved_bytes == 0
    restarted.add_request(request("a", budget=None, prompt=20, max_tokens=8))  # ... and queues in the new one
    restarted.step()
    assert restarted.cache_manager.observe_in_use() == restarted.kv_bytes_in_use > 0
    assert pool.in_use_bytes == restarted.kv_bytes_in_use
    while restarted.has_unfinished():
        restarted.step()
    assert pool.reserved_bytes == 0  # released as the request ended


def test_every_byte_the_instance_holds_is_in_the_ledger_warm_prefixes_too(decoder):
    pool = KVReservations(None, decoder.spec)
    engine = Engine(decoder, EngineConfig(prefill_chunk=8), reservations=pool)
    assert engine.warm_prefix(list(range(3, 19)), CacheConfig("streaming", budget=16)) == 16
    prefixes = engine.cache_manager.prefixes.nbytes
    assert prefixes > 0 and engine.kv_bytes_in_use == 0  # nothing runs: the prefix's snapshot is all it holds
    assert engine.cache_manager.observe_in_use() == pool.in_use_bytes == prefixes
