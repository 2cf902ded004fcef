"""Sessions through the engine on the tiny exported model: a conversation continued from saved state
gives what sending the whole history gives (full cache, greedy), and a bounded cache continues as one
long sequence would, from memory or from a checkpoint read by a fresh engine."""

from __future__ import annotations

import numpy as np
import pytest

from kvpop.cache import SlotCache
from kvpop.cache.manager import append_output
from kvpop.decoder import DecoderStep
from kvpop.engine import Engine, EngineConfig
from kvpop.request import CacheConfig, GenerationRequest, SamplingParams
from kvpop.sessions import COLD, HOT, SessionStore, TierLimits, model_fingerprint

TURNS = 10
REPLY = 8


def make_store(model_dir, tmp_path, hot=1 << 30, warm=1 << 30) -> SessionStore:
    return SessionStore(TierLimits(hot_bytes=hot, warm_bytes=warm, cold_dir=tmp_path / "sessions"), model_fingerprint(model_dir))


def user_turn(turn: int) -> list[int]:
    rng = np.random.default_rng(100 + turn)
    return rng.integers(3, 250, 40 if turn == 0 else int(rng.integers(3, 9))).tolist()


def run(engine: Engine, request_id: str, prompt: list[int], cache: CacheConfig, session_id: str | None = None):
    sampling = SamplingParams(max_tokens=REPLY, ignore_eos=True)
    [result] = engine.generate([GenerationRequest(request_id, prompt, sampling, cache, session_id=session_id)])
    return result


def test_ten_turns_with_a_session_equal_sending_the_whole_history(decoder, tiny_onnx_model_dir, tmp_path):
    with_sessions = Engine(decoder, EngineConfig(prefill_chunk=16), sessions=make_store(tiny_onnx_model_dir, tmp_path))
    cold = Engine(decoder, EngineConfig(prefill_chunk=16))
    history: list[int] = []
    for turn in range(TURNS):
        prompt = history + user_turn(turn)
        resumed = run(with_sessions, f"s{turn}", prompt, CacheConfig(), session_id="chat-1")
        reference = run(cold, f"c{turn}", prompt, CacheConfig())
        assert resumed.output_ids == reference.output_ids, f"turn {turn}"
        assert reference.tokens_reused == 0
        # Every token but the last reply token (sampled, never fed) came from the session.
        assert resumed.tokens_reused == (max(len(history) - 1, 0)), f"turn {turn}"
        assert resumed.session_tier == (None if turn == 0 else HOT)
        history = prompt + resumed.output_ids


def test_a_prompt_that_does_not_continue_the_session_prefills_cold(decoder, tiny_onnx_model_dir, tmp_path):
    engine = Engine(decoder, sessions=make_store(tiny_onnx_model_dir, tmp_path))
    first = run(engine, "a", user_turn(0), CacheConfig(), session_id="s")
    edited = [user_turn(0)[0] + 1] + user_turn(0)[1:] + first.output_ids + user_turn(1)
    assert run(engine, "b", edited, CacheConfig(), session_id="s").tokens_reused == 0
    other_budget = CacheConfig(policy="streaming", budget=32, options=dict(sinks=2))  # other options: cold as well
    history = edited + run(engine, "c", edited, CacheConfig(), session_id="s").output_ids
    assert run(engine, "d", history + [5], other_budget, session_id="s").tokens_reused == 0
    assert engine.close_session("s") and not engine.close_session("s")
    with pytest.raises(ValueError, match="session_id"):
        engine.add_request(GenerationRequest("e", [1, 2], session_id="../x"))
    with pytest.raises(ValueError, match="keeps no sessions"):
        Engine(decoder).add_request(GenerationRequest("f", [1, 2], session_id="ok"))


def one_long_sequence(decoder: DecoderStep, cache: SlotCache, segments, chunk: int) -> int:
    """Feed `segments` ((tokens, "prefill") in chunks, or (tokens, "decode") one at a time) into one
    cache, as an uninterrupted sequence would; the greedy token after the last one."""
    for tokens, mode in segments:
        size = chunk if mode == "prefill" else 1
        for start in range(0, len(tokens), size):
            piece = tokens[start : start + size]
            positions = np.arange(cache.tokens_seen, cache.tokens_seen + len(piece))[None]
            out = decoder.run(np.array([piece]), positions, cache.key[:, None], cache.value[:, None],
                              cache.slot_mask()[None], last_only=True, attention=cache.policy.needs_attention)
            append_output(cache, out, 0)
    return int(np.argmax(out.logits[0, -1]))


@pytest.mark.parametrize("policy", ["streaming", "h2o", "tova", "random", "kvpop"])
def test_a_bounded_session_continues_the_cache_of_one_long_sequence(decoder, tiny_onnx_model_dir, tmp_path, policy):
    config = CacheConfig(policy=policy, budget=24, options=dict(sinks=2, window=4, seed=7))
    engine = Engine(decoder, EngineConfig(prefill_chunk=16), sessions=make_store(tiny_onnx_model_dir, tmp_path))
    prompt = user_turn(0)
    first = run(engine, "t1", prompt, config, session_id="long")
    second_prompt = prompt + first.output_ids + user_turn(1)
    second = run(engine, "t2", second_prompt, config, session_id="long")
    assert second.tokens_reused == len(prompt) + REPLY - 1 and second.tokens_seen == len(second_prompt) + REPLY - 1

    cache = SlotCache(decoder.spec, config.build_policy(), 24)
    new_tokens = [first.output_ids[-1], *user_turn(1)]
    segments = [(prompt, "prefill"), (first.output_ids[:-1], "decode"), (new_tokens, "prefill"), (second.output_ids[:-1], "decode")]
    one_long_sequence(decoder, cache, segments, chunk=16)
    saved = engine.sessions.get("long")
    np.testing.assert_array_equal(saved.tokens, second_prompt + second.output_ids[:-1])
    np.testing.assert_array_equal(saved.position, cache.position)
    np.testing.assert_allclose(saved.key, cache.key, rtol=0, atol=1e-6)

    # A fresh engine (a restarted server) reads the checkpoint and goes on identically.
    third_prompt = second_prompt + second.output_ids + user_turn(2)
    expected = run(engine, "t3", third_prompt, config, session_id="long")
    assert engine.sessions.close(timeout=30)  # the first server stops: its last checkpoint is written
    restarted = Engine(decoder, EngineConfig(prefill_chunk=16), sessions=make_store(tiny_onnx_model_dir, tmp_path, hot=0, warm=0))
    restarted.sessions.put("long", saved)  # the state as it was after turn 2 (t3 moved it on)
    assert restarted.sessions.flush(timeout=30)  # on disk only: the turn reads the checkpoint
    again = run(restarted, "t3", third_prompt, config, session_id="long")
    assert again.output_ids == expected.output_ids and again.session_tier == COLD
    assert again.tokens_reused == expected.tokens_reused == len(second_prompt) + REPLY - 1
