"""Prompt lookahead (kvpop.cache.lookahead): the prompt's tail scores the prompt while it is prefilled."""

from __future__ import annotations

import numpy as np
import pytest

from kvpop.cache import SlotCache
from kvpop.cache.lookahead import FLOOR, chunk_queries, lookahead_scores
from kvpop.engine import CacheConfig, Engine, GenerationRequest, SamplingParams
from kvpop.model_spec import ModelSpec
from kvpop.policies import make_policy
from kvpop.policies.kvpop import LOOKAHEAD, SCORE
from kvpop.policies.scorers import TokenScorer


def test_the_tail_runs_after_every_chunk_but_the_last():
    assert chunk_queries(100, 0, 0, 32).rows is None  # off
    first = chunk_queries(100, 8, 0, 32)
    assert (first.appended, first.rows) == (8, slice(32, 40))  # after the chunk's own 32 rows
    last = chunk_queries(100, 8, 96, 4)  # 4 tokens left: the tail is the chunk's last rows
    assert (last.appended, last.rows) == (0, slice(0, 4))
    assert chunk_queries(100, 8, 64, 36).rows == slice(28, 36)
    assert chunk_queries(5, 8, 0, 2).appended == 5  # never more than the prompt


def test_scores_are_log_mean_attention_max_over_the_group():
    # 1 layer, 4 query heads in 2 KV groups, 3 rows of which the last 2 are tail queries, 2 slots.
    attention = np.zeros((1, 4, 3, 5), np.float32)  # S = 5 > capacity 2: padding
    chunk_attention = np.zeros((1, 4, 3, 3), np.float32)
    attention[0, 1, 1:, 0] = [0.5, 0.3]  # head 1 (group 0) on slot 0
    attention[0, 2, 1:, 1] = [0.2, 0.2]  # head 2 (group 1) on slot 1
    chunk_attention[0, 0, 2, 0] = 0.8  # head 0 (group 0), the last query, on the chunk's token 0
    scores = lookahead_scores(attention, chunk_attention, slice(1, 3), capacity=2, length=1, group=2)
    assert scores.shape == (1, 2, 3)  # (L, Hkv, C + T)
    np.testing.assert_allclose(np.exp(scores[0]), [[0.4, 0.0, 0.4], [0.0, 0.2, 0.0]], atol=1e-6)


def test_tail_queries_do_not_change_the_chunk(decoder):
    """The chunk's keys, values and attention are the same with the tail run after it (causal)."""
    from kvpop.decoder import StepOutput

    rng = np.random.default_rng(0)
    ids = rng.integers(3, 200, size=(1, 12)).astype(np.int64)
    positions = np.arange(12, dtype=np.int64)[None]
    past_key, past_value, mask = decoder.empty_cache(1, 0)
    alone = decoder.run(ids[:, :8], positions[:, :8], past_key, past_value, mask, last_only=True, attention=True)
    tail = np.concatenate([ids, ids[:, -3:]], axis=1), np.concatenate([positions, [[40, 41, 42]]], axis=1)
    with_tail: StepOutput = decoder.run(*tail, past_key, past_value, mask, last_only=True, attention=True)
    with_tail = with_tail.first_tokens(8)
    np.testing.assert_allclose(with_tail.new_key[:, :, :, :8], alone.new_key, atol=1e-5)
    np.testing.assert_allclose(with_tail.new_value, alone.new_value, atol=1e-5)
    np.testing.assert_allclose(with_tail.chunk_attention, alone.chunk_attention, atol=1e-5)


class _Indifferent(TokenScorer):
    """A learned-scale scorer that ranks every token alike (log attention of a uniform row)."""

    name = "indifferent"
    log_attention_scores = True

    def score(self, cache, state, leaving):
        return np.full(leaving.positions.shape, -5.0, np.float32)


SPEC = ModelSpec("LlamaForCausalLM", num_layers=1, num_attention_heads=2, num_kv_heads=1, head_dim=4, vocab_size=16,
                 dtype="float32", max_position_embeddings=512)


def test_what_the_tail_attends_to_is_kept():
    """Budget 6 = 1 sink + 2 window + 3 long-range slots; 16 tokens in chunks of 4. The tail puts its
    attention on tokens 3, 7 and 9 only; the scorer ranks all alike, so lookahead alone decides."""
    policy = make_policy("kvpop", sinks=1, window=2, scorer=_Indifferent(), lookahead=2)
    cache = SlotCache(SPEC, policy, budget=6)
    wanted = {3: 0.5, 7: 0.3, 9: 0.1}
    for start in range(0, 16, 4):
        positions = np.arange(start, start + 4)
        old = cache.position[0, 0].copy()  # (C,) what the tail sees in the cache
        on_cache = np.array([wanted.get(int(p), 0.0) if p >= 0 else 0.0 for p in old], np.float32)
        on_chunk = np.array([wanted.get(int(p), 0.0) for p in positions], np.float32)
        lookahead = np.log(np.concatenate([on_cache, on_chunk]) + 1e-9)[None, None]  # (1, 1, C + 4)
        key = np.repeat(positions.astype(np.float32)[None, None, :, None], 4, axis=3)
        cache.append(key, key, None, None, lookahead)
        assert cache.length <= 6
    kept = set(cache.position[0, 0].tolist())
    assert kept == {0, 3, 7, 9, 14, 15}  # the sink, the three the tail wanted, the window
    outside = (cache.position >= 1) & (cache.position < 14)
    assert (cache.statistics[SCORE][outside] >= cache.statistics[LOOKAHEAD][outside]).all()


def test_without_lookahead_the_same_cache_forgets_them():
    policy = make_policy("kvpop", sinks=1, window=2, scorer=_Indifferent())
    cache = SlotCache(SPEC, policy, budget=6)
    for start in range(0, 16, 4):
        key = np.repeat(np.arange(start, start + 4, dtype=np.float32)[None, None, :, None], 4, axis=3)
        cache.append(key, key, None, None)
    assert not {3, 7, 9} <= set(cache.position[0, 0].tolist())


def test_lookahead_needs_a_scorer_on_the_log_attention_scale():
    with pytest.raises(ValueError, match="lookahead"):
        CacheConfig(policy="kvpop", budget=16, lookahead=8)  # the attention stand-in scorer
    with pytest.raises(ValueError, match="lookahead must be"):
        CacheConfig(policy="kvpop", budget=16, scorer="mlstm", lookahead=-1)
    assert CacheConfig(policy="h2o", budget=16, lookahead=8).prompt_lookahead == 0  # kvpop's option alone


@pytest.mark.parametrize("scorer", ["mlstm", "mlp"])
def test_engine_prefills_with_lookahead_within_the_budget(tiny_onnx_model_dir, scorer):
    """Through the engine: tail queries run with the prompt's chunks, the cache stays at its budget,
    every token outside the window is kept by at least its lookahead score, generated tokens carry
    none. (What lookahead keeps is the constructed case above; this tiny scorer is not calibrated.)"""
    rng = np.random.default_rng(3)
    prompt = rng.integers(3, 200, size=200).tolist()
    for lookahead in (0, 12):
        engine = Engine.from_model_dir(tiny_onnx_model_dir, prefill_chunk=16)
        config = CacheConfig(policy="kvpop", budget=80, sinks=2, scorer=scorer, lookahead=lookahead)
        request = GenerationRequest(f"r{lookahead}", prompt, SamplingParams(max_tokens=6, ignore_eos=True), config)
        engine.add_request(request)
        while not engine._running:
            engine.step()
        cache = engine._running[request.request_id].cache
        assert cache.length <= 80 and cache.tokens_seen == len(prompt)
        if lookahead:
            assert np.isfinite(cache.statistics[LOOKAHEAD]).all()  # every prompt token was seen by the tail
            outside = (cache.position >= 2) & (cache.position < len(prompt) - cache.policy.protected_counts(80)[1])
            assert outside.any() and (cache.statistics[SCORE][outside] >= cache.statistics[LOOKAHEAD][outside]).all()
            engine.step(), engine.step()
            generated = cache.position >= len(prompt)
            assert generated.any() and (cache.statistics[LOOKAHEAD][generated] == FLOOR).all()
        while engine.has_unfinished():
            engine.step()
        assert len(engine.result(request.request_id).output_ids) == 6
