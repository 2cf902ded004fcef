"""The engine's scheduler on the tiny exported model: chunked prefill interleaved with decode under a
per-step token budget, batched prefill chunks, and the lean decoder-step variants. No timing."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from kvpop.decoder import DecoderStep, variant_paths
from kvpop.engine import Engine, EngineConfig, Phase
from kvpop.request import CacheConfig, GenerationRequest, SamplingParams
from kvpop.policies import POLICIES

RUNNING_PROMPTS = [[0, 5, 17, 99, 23], [0, 250, 3], [0, 9, 8, 7, 6, 5, 4]]
rng = np.random.default_rng(7)
LONG_PROMPT = [0] + [int(token) for token in rng.integers(3, 250, size=95)]  # 96 tokens: 12 chunks of 8


def cache_config(policy: str) -> CacheConfig:
    return CacheConfig(policy=policy, budget=None if policy == "full" else 12, options=dict(sinks=2, window=4))


def request(name: str, prompt: list[int], policy: str, max_tokens: int) -> GenerationRequest:
    return GenerationRequest(name, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), cache_config(policy))


def streams_and_a_long_prompt(decoder, policy: str):
    """Three 40-token streams, the 96-token prompt that arrives while they decode, and each one's
    output when it runs alone."""
    streams = [request(f"s{i}", prompt, policy, 40) for i, prompt in enumerate(RUNNING_PROMPTS)]
    long = request("long", LONG_PROMPT, policy, 6)
    alone = {r.request_id: Engine(decoder, EngineConfig(prefill_chunk=8)).generate([r])[0].output_ids for r in [*streams, long]}
    return streams, long, alone


@pytest.mark.parametrize("policy", list(POLICIES))
def test_long_prefill_interleaves_with_running_streams(decoder, policy):
    """A long prompt arriving while three streams decode is fed one chunk per step: every running
    stream still gets a token at every step, no step feeds more than the token budget, and every
    output (the running streams' and the long prompt's) equals the output of that request alone."""
    streams, long, alone = streams_and_a_long_prompt(decoder, policy)

    engine = Engine(decoder, EngineConfig(max_batch_size=4, prefill_chunk=8, max_step_tokens=8))
    for stream in streams:
        engine.add_request(stream)
    for _ in range(3):  # the three streams are decoding
        engine.step()
    engine.add_request(long)
    fed, steps_while_prefilling = [0], 0
    while engine.has_unfinished():
        running_before = [s.request_id for s in streams if s.request_id in engine.state().decoding]
        events = engine.step()
        got_token = {event.request_id for event in events}
        sequence = prefilling(engine, "long")
        if sequence is not None or "long" in got_token and not fed[-1] == len(LONG_PROMPT):
            prefilled = sequence.prefilled if sequence is not None else len(LONG_PROMPT)
            assert prefilled - fed[-1] <= 8  # the per-step token budget
            fed.append(prefilled)
            steps_while_prefilling += 1
            assert set(running_before) <= got_token  # no running stream skipped a step
    assert steps_while_prefilling >= len(LONG_PROMPT) // 8
    for r in [*streams, long]:
        assert engine.result(r.request_id).output_ids == alone[r.request_id], r.request_id


def prefilling(engine: Engine, name: str):
    """Request `name`'s state while its prompt is being fed, else None."""
    state = engine.sequence(name)
    return state if state is not None and state.phase == Phase.PREFILLING else None


def prefilled_cache(engine: Engine, name: str):
    """Step `engine` until request `name`'s prompt is in; its cache then."""
    while name not in engine.state().decoding:
        engine.step()
    return engine.sequence(name).cache


@pytest.mark.parametrize("policy", list(POLICIES))
def test_a_chunk_cut_in_pieces_enters_the_cache_as_one(decoder, policy):
    """A step budget (3 tokens) smaller than the chunk (8) while streams decode: the long prompt is
    computed in pieces of at most 3 tokens per step, every running stream still gets a token at every
    step, and the prompt's cache (what each head kept, its keys, the policy's statistics) and every
    answer are those of whole chunks (kvpop.kvtypes.StagedChunk)."""
    whole = Engine(decoder, EngineConfig(prefill_chunk=8))
    whole.add_request(request("long", LONG_PROMPT, policy, 6))
    expected = prefilled_cache(whole, "long")
    streams = [request(f"s{i}", prompt, policy, 60) for i, prompt in enumerate(RUNNING_PROMPTS)]
    engine = Engine(decoder, EngineConfig(max_batch_size=4, prefill_chunk=8, max_step_tokens=3))
    for stream in streams:
        engine.add_request(stream)
    engine.step()
    engine.add_request(request("long", LONG_PROMPT, policy, 6))
    fed = 0
    while "long" not in engine.state().decoding:
        running = set(engine.state().decoding)
        got_token = {event.request_id for event in engine.step()}
        sequence = engine.sequence("long")
        assert sequence.prefilled - fed <= 3 and running <= got_token
        fed = sequence.prefilled
    cache = engine.sequence("long").cache
    np.testing.assert_array_equal(cache.position, expected.position)
    np.testing.assert_allclose(cache.key, expected.key, atol=1e-5)
    assert cache.statistics.keys() == expected.statistics.keys()
    for name, values in cache.statistics.items():
        np.testing.assert_allclose(values, expected.statistics[name], atol=1e-5, err_msg=name)
    while engine.has_unfinished() or whole.has_unfinished():
        engine.step(), whole.step()
    assert engine.result("long").output_ids == whole.result("long").output_ids
    alone = Engine(decoder, EngineConfig(prefill_chunk=8)).generate([request("s0", RUNNING_PROMPTS[0], policy, 60)])[0]
    assert engine.result("s0").output_ids == alone.output_ids


@pytest.mark.parametrize("policy", ["full", "kvpop", "h2o", "streaming"])
def test_prefill_chunks_of_several_prompts_are_batched(decoder, policy):
    """With room for several chunks per step, new prompts' chunks of equal length run as one call
    (stacked, padded caches) and give the same tokens as each prompt alone."""
    prompts = [LONG_PROMPT[:40], LONG_PROMPT[10:50], LONG_PROMPT[:27], [0, 4, 5]]
    batch = [request(f"p{i}", prompt, policy, 10) for i, prompt in enumerate(prompts)]
    alone = [Engine(decoder, EngineConfig(prefill_chunk=8)).generate([r])[0].output_ids for r in batch]
    engine = Engine(decoder, EngineConfig(max_batch_size=4, prefill_chunk=8, max_step_tokens=32))
    calls = []
    original = engine.decoder.run

    def counting_run(input_ids, *args, **kwargs):
        calls.append(input_ids.shape)
        return original(input_ids, *args, **kwargs)

    engine.runner.decoder = type("Counting", (), {"run": staticmethod(counting_run), "spec": decoder.spec,
                                                  "empty_cache": decoder.empty_cache})()
    engine.scheduler.has_mixed_step = False
    assert [r.output_ids for r in engine.generate(batch)] == alone
    assert any(batch_size > 1 and tokens == 8 for batch_size, tokens in calls)  # a batched prefill call


def test_lean_variants_return_only_what_the_policies_read(tiny_onnx_model_dir, decoder, tmp_path):
    """Export wrote the last-position variants; a step without attention returns none and the same
    last-position logits and keys; an engine over an export without variants gives the same tokens."""
    assert decoder.has_lean_variants
    shape = (decoder.spec.num_layers, 2, decoder.spec.num_kv_heads, 5, decoder.spec.head_dim)
    rng = np.random.default_rng(0)
    inputs = (
        rng.integers(0, 250, (2, 3)), np.tile(np.arange(5, 8), (2, 1)),
        rng.standard_normal(shape).astype(np.float32), rng.standard_normal(shape).astype(np.float32),
        np.array([[True] * 5, [True] * 3 + [False] * 2]),
    )
    full = decoder.run(*inputs)
    lean = decoder.run(*inputs, last_only=True, attention=False)
    with_attention = decoder.run(*inputs, last_only=True, attention=True)
    assert lean.attention is None and lean.chunk_attention is None
    assert lean.logits.shape == (2, 1, decoder.spec.vocab_size)
    np.testing.assert_allclose(lean.logits, full.logits[:, -1:], atol=1e-5)
    np.testing.assert_allclose(lean.new_key, full.new_key, atol=1e-6)
    np.testing.assert_allclose(with_attention.attention, full.attention, atol=1e-6)

    plain_dir = tmp_path / "no-variants"
    shutil.copytree(tiny_onnx_model_dir, plain_dir)
    for path in variant_paths(plain_dir / decoder.spec.decoder_file).values():
        path.unlink()
    plain = DecoderStep(plain_dir, threads=1)
    assert not plain.has_lean_variants
    mixed = [request(f"m{i}", prompt, policy, 12) for i, (prompt, policy) in
             enumerate(zip(RUNNING_PROMPTS * 2, POLICIES))]
    assert [r.output_ids for r in Engine(plain).generate(mixed)] == [r.output_ids for r in Engine(decoder).generate(mixed)]


@pytest.mark.parametrize("floor", [1, 32])
def test_a_small_budget_prefills_in_chunks_of_at_least_the_floor(decoder, monkeypatch, floor):
    """`min_bounded_chunk` (the service's min_prefill_chunk_tokens) sets how many prompt tokens a
    bounded cache takes per call; the cache it keeps stays at its budget."""
    engine = Engine(decoder, EngineConfig(prefill_chunk=256, min_bounded_chunk=floor))
    chunks = []
    run_chunk = engine.runner.prompt_piece
    monkeypatch.setattr(engine.runner, "prompt_piece", lambda sequences, length: (chunks.append(length), run_chunk(sequences, length))[1])
    result, = engine.generate([request("small", LONG_PROMPT, "streaming", max_tokens=4)])
    expected = [12] * 8 if floor == 1 else [32, 32, 32]  # 96 prompt tokens, budget 12
    assert chunks == expected
    assert result.budget == 12 and result.tokens_evicted == result.tokens_seen - 12


@pytest.mark.parametrize("policy", ["full", "kvpop"])
def test_paced_prefill_changes_when_tokens_arrive_not_which(decoder, policy):
    """With prefill pacing (kvpop.engine.prefill_pacer) the long prompt is fed in pieces sized from measured
    step times while streams decode; every answer is still the one of that request alone."""
    streams, long, alone = streams_and_a_long_prompt(decoder, policy)
    engine = Engine(decoder, EngineConfig(max_batch_size=4, prefill_chunk=32, prefill_pacing=1.0))
    for stream in streams:
        engine.add_request(stream)
    engine.step()
    engine.add_request(long)
    fed = []
    while "long" not in engine.state().decoding and engine.has_unfinished():
        engine.step()
        sequence = engine.sequence("long")
        fed.append(sequence.prefilled)
    assert fed[0] == engine.scheduler.pacer.min_tokens  # it starts small beside running streams
    while engine.has_unfinished():
        engine.step()
    reference = Engine(decoder, EngineConfig(prefill_chunk=32)).generate([long])[0].output_ids
    assert engine.result("long").output_ids == reference
    for stream in streams:
        assert engine.result(stream.request_id).output_ids == alone[stream.request_id]


def test_a_step_ends_when_its_leftover_budget_is_too_small_for_a_piece(decoder):
    """Two bounded prompts of 12-token chunks under a 20-token step budget: after one chunk the 8 tokens
    left start no piece (MIN_PIECE_TOKENS), and the step ends instead of looking for one forever."""
    import threading

    engine = Engine(decoder, EngineConfig(max_batch_size=4, prefill_chunk=256, max_step_tokens=20))
    engine.add_request(request("stream", RUNNING_PROMPTS[0], "streaming", 40))
    engine.step()  # decoding: the step budget is max_step_tokens
    batch = [request(f"b{i}", LONG_PROMPT[: 40 + i], "streaming", 4) for i in range(2)]
    done = []
    worker = threading.Thread(target=lambda: done.append(engine.generate(batch)), daemon=True)
    worker.start()
    worker.join(timeout=60)
    assert done, "an engine step did not return"
    alone = [Engine(decoder).generate([r])[0].output_ids for r in batch]
    assert [r.output_ids for r in done[0]] == alone


def test_the_step_that_ends_the_last_stream_keeps_the_step_budget(decoder):
    """A stream's last token leaves with its step's events, so that step's prompt work stays within
    `max_step_tokens` too (before: every stream having finished, the step fed a whole chunk and the
    last token waited for it, the worst gap a running stream saw)."""
    engine = Engine(decoder, EngineConfig(max_batch_size=4, prefill_chunk=64, max_step_tokens=8))
    engine.add_request(request("stream", RUNNING_PROMPTS[0], "full", 3))
    engine.step()  # prompt in, token 1
    engine.add_request(request("long", LONG_PROMPT, "full", 2))
    finished = False
    while not finished:
        before = engine.sequence("long").prefilled if "long" in engine.state().prefilling else 0
        events = engine.step()
        finished = any(event.request_id == "stream" and event.finished for event in events)
        after = engine.sequence("long").prefilled if "long" in engine.state().prefilling else len(LONG_PROMPT)
        assert after - before <= 8
    assert "long" in engine.state().prefilling  # the next step, with nothing decoding, takes a whole chunk
    engine.step()
    assert engine.sequence("long").prefilled > 16


def counted(decoder: DecoderStep) -> dict[str, int]:
    """Count `decoder`'s calls by kind (instance attributes wrap its methods)."""
    calls = {"run": 0, "run_mixed": 0}
    for name in calls:
        original = getattr(decoder, name)

        def wrapper(*args, _original=original, _name=name, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)

        setattr(decoder, name, wrapper)
    return calls


@pytest.mark.parametrize("policy", ["full", "streaming", "random", "kvpop:mlstm", "h2o"])
def test_the_decode_step_and_a_prompt_piece_share_one_mixed_call(tiny_onnx_model_dir, policy):
    """With the mixed step exported, a step that decodes running streams and feeds a piece of a new
    prompt makes one decoder call instead of two, and every answer and the new prompt's cache are
    those of separate calls. A policy that reads attention (h2o) keeps separate calls."""
    from kvpop.policies.kvpop import load_learned_scorers

    scorers = load_learned_scorers(tiny_onnx_model_dir)
    if policy == "kvpop:mlstm":
        config = CacheConfig(policy="kvpop", budget=40, options=dict(sinks=2, scorer="mlstm"))
    else:
        config = cache_config(policy)
    results = {}
    for mixed in (True, False):
        decoder = DecoderStep(tiny_onnx_model_dir, threads=1, mixed=mixed)
        assert decoder.has_mixed_step == mixed
        calls = counted(decoder)
        engine = Engine(decoder, EngineConfig(max_batch_size=4, prefill_chunk=8, max_step_tokens=8), policy_assets={"kvpop": scorers})
        streams = [GenerationRequest(f"s{i}", prompt, SamplingParams(max_tokens=30, ignore_eos=True), config)
                   for i, prompt in enumerate(RUNNING_PROMPTS)]
        for stream in streams:
            engine.add_request(stream)
        for _ in range(3):  # the streams are decoding
            engine.step()
        engine.add_request(GenerationRequest("long", LONG_PROMPT, SamplingParams(max_tokens=6, ignore_eos=True), config))
        before = dict(calls)
        cache = prefilled_cache(engine, "long")
        prefill_steps = {name: calls[name] - before[name] for name in calls}
        while engine.has_unfinished():
            engine.step()
        results[mixed] = (prefill_steps, cache, {r: engine.result(r).output_ids for r in ["long", "s0", "s1", "s2"]})
    (mixed_calls, mixed_cache, mixed_answers), (separate_calls, separate_cache, separate_answers) = results[True], results[False]
    assert mixed_answers == separate_answers
    np.testing.assert_array_equal(mixed_cache.position, separate_cache.position)
    np.testing.assert_allclose(mixed_cache.key, separate_cache.key, atol=1e-5)
    assert separate_calls["run_mixed"] == 0
    steps = len(LONG_PROMPT) // 8  # one 8-token piece per step, each beside the streams' decode step
    if policy == "h2o":
        assert mixed_calls == separate_calls  # attention is read: no mixed call
    else:
        assert mixed_calls["run_mixed"] == steps and mixed_calls["run"] == 0
        assert separate_calls["run"] == 2 * steps


def test_a_learned_scorer_takes_a_staged_chunk_in_piece_by_piece(tiny_onnx_model_dir):
    """kvpop with the learned mLSTM scorer, its chunk cut in pieces beside running streams: the scorer
    takes each piece in as it is computed (`KVpopPolicy.stage`), so the step that completes the chunk
    runs no scorer call for it, and the cache (kept positions, keys, scores) and the answers are those
    of whole chunks."""
    from kvpop.policies.kvpop import load_learned_scorers
    from kvpop.policies.kvpop import SCORE

    scorers = load_learned_scorers(tiny_onnx_model_dir)
    config = CacheConfig(policy="kvpop", budget=24, options=dict(sinks=2, scorer="mlstm"))
    long = lambda: GenerationRequest("long", LONG_PROMPT, SamplingParams(max_tokens=6, ignore_eos=True), config)  # noqa: E731
    decoder = DecoderStep(tiny_onnx_model_dir, threads=1)
    whole = Engine(decoder, EngineConfig(prefill_chunk=24), policy_assets={"kvpop": scorers})
    whole.add_request(long())
    expected = prefilled_cache(whole, "long")
    engine = Engine(decoder, EngineConfig(max_batch_size=4, prefill_chunk=24, max_step_tokens=5), policy_assets={"kvpop": scorers})
    streams = CacheConfig(policy="streaming", budget=24, options=dict(sinks=2))  # no scorer calls of their own to count
    for i, prompt in enumerate(RUNNING_PROMPTS):
        engine.add_request(GenerationRequest(f"s{i}", prompt, SamplingParams(max_tokens=60, ignore_eos=True), streams))
    engine.step()
    engine.add_request(long())
    runtime = scorers["mlstm"].runtime
    calls, original = [], runtime.step
    runtime.step = lambda *args, **kwargs: (calls.append(args[1].shape[2]), original(*args, **kwargs))[1]  # rows per call
    try:
        completions = 0
        while "long" not in engine.state().decoding:
            sequence = prefilling(engine, "long")
            staged_before = 0 if sequence is None else sequence.staged_tokens
            calls.clear()
            engine.step()
            if staged_before and engine.sequence("long").staged_tokens == 0:  # this step completed a chunk cut in pieces
                completions += 1
                assert max(calls, default=0) <= 5  # only this step's piece went through the scorer
    finally:
        runtime.step = original
    assert completions >= 2
    cache = engine.sequence("long").cache
    np.testing.assert_array_equal(cache.position, expected.position)
    np.testing.assert_allclose(cache.key, expected.key, atol=1e-5)
    np.testing.assert_allclose(cache.statistics[SCORE], expected.statistics[SCORE], atol=1e-4)
    while engine.has_unfinished() or whole.has_unfinished():
        engine.step(), whole.step()
    assert engine.result("long").output_ids == whole.result("long").output_ids
