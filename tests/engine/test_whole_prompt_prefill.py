"""Whole-prompt prefill (Engine `whole_prompt_tokens`): a bounded cache whose policy reads no attention
takes its prompt in one chunk, with full attention, and evicts once after it (compress after prefill);
policies that read attention, and longer prompts, still evict as they prefill. Tiny exported model."""

from __future__ import annotations

import numpy as np
import pytest

from kvpop.engine import Engine, EngineConfig
from kvpop.request import CacheConfig, GenerationRequest, SamplingParams

rng = np.random.default_rng(11)
PROMPT = [0] + [int(token) for token in rng.integers(3, 250, size=79)]  # 80 tokens, budget 16


def generate(engine: Engine, policy: str, max_tokens: int = 8, prompt: list[int] = PROMPT):
    config = CacheConfig(policy=policy, budget=None if policy == "full" else 16, options=dict(sinks=2, window=4))
    request = GenerationRequest(f"{policy}-{len(prompt)}", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), config)
    return engine.generate([request])[0]


def test_a_whole_prompt_answers_its_first_token_from_full_attention_then_keeps_its_budget(decoder):
    whole = Engine(decoder, EngineConfig(prefill_chunk=8, whole_prompt_tokens=len(PROMPT)))
    evicting = Engine(decoder, EngineConfig(prefill_chunk=8))
    full = generate(evicting, "full")
    for policy in ("streaming", "random"):  # read no attention
        result = generate(whole, policy)
        assert result.output_ids[0] == full.output_ids[0]  # the prompt's last logits saw every prompt token
        assert result.budget == 16 and result.peak_kv_bytes < full.peak_kv_bytes  # then only its budget is kept
        assert whole.scheduler.prefills_whole(CacheConfig(policy=policy, budget=16).build_policy(), 16, len(PROMPT))
    # Evicting while prefilling changes the answer here (the tiny model's prompt is random tokens).
    assert generate(evicting, "streaming").output_ids != generate(whole, "streaming").output_ids


def test_policies_that_read_attention_and_longer_prompts_still_evict_while_prefilling(decoder):
    whole = Engine(decoder, EngineConfig(prefill_chunk=8, whole_prompt_tokens=len(PROMPT)))
    evicting = Engine(decoder, EngineConfig(prefill_chunk=8))
    h2o = CacheConfig(policy="h2o", budget=16).build_policy()
    assert h2o.needs_attention and not whole.scheduler.prefills_whole(h2o, 16, len(PROMPT))
    assert generate(whole, "h2o").output_ids == generate(evicting, "h2o").output_ids
    longer = PROMPT + PROMPT[1:9]  # one token over: evicts as it prefills, as with whole_prompt_tokens=0
    assert generate(whole, "streaming", prompt=longer).output_ids == generate(evicting, "streaming", prompt=longer).output_ids


def test_a_whole_prompt_computed_in_pieces_answers_as_in_one_call(decoder):
    """The step token budget splits the prompt's compute (kvpop.kvtypes.StagedChunk), not its one eviction."""
    one_call = Engine(decoder, EngineConfig(prefill_chunk=len(PROMPT), whole_prompt_tokens=len(PROMPT)))
    pieces = Engine(decoder, EngineConfig(prefill_chunk=8, max_step_tokens=5, whole_prompt_tokens=len(PROMPT)))
    assert generate(pieces, "streaming", 12).output_ids == generate(one_call, "streaming", 12).output_ids


def test_no_warm_prefix_for_a_cache_that_prefills_whole(decoder):
    """A cold request would take prefix and rest as one chunk: no prefix state equals it."""
    engine = Engine(decoder, EngineConfig(prefill_chunk=8, whole_prompt_tokens=len(PROMPT)))
    assert engine.warm_prefix(PROMPT[:40], CacheConfig(policy="streaming", budget=16, options=dict(sinks=2, window=4))) == 0
    assert engine.warm_prefix(PROMPT[:40], CacheConfig(policy="h2o", budget=16, options=dict(sinks=2, window=4))) == 40


def test_a_whole_prompt_prefill_says_what_it_holds_beyond_its_cache(decoder):
    """What admission reserves beyond the cache until the first token (`AdmissionPlan.prefill_slots`) and kv_bytes_in_use while the
    prompt's pieces are staged."""
    engine = Engine(decoder, EngineConfig(prefill_chunk=8, max_step_tokens=8, whole_prompt_tokens=len(PROMPT)))

    def request(policy: str, prompt: list[int] = PROMPT) -> GenerationRequest:
        config = CacheConfig(policy=policy, budget=None if policy == "full" else 16, options=dict(sinks=2, window=4))
        return GenerationRequest(f"{policy}-{len(prompt)}", prompt, SamplingParams(max_tokens=4, ignore_eos=True), config)

    assert engine.read(request("streaming")).plan.prefill_slots == len(PROMPT)
    assert engine.read(request("h2o")).plan.prefill_slots == engine.read(request("full")).plan.prefill_slots == 0
    assert engine.read(request("streaming", PROMPT + PROMPT[1:9])).plan.prefill_slots == 0  # longer: evicts while prefilling
    engine.add_request(request("streaming"))
    engine.step(), engine.step()  # two 8-token pieces of the 80-token chunk, staged beside the cache
    bytes_per_token = decoder.spec.kv_bytes_per_token
    state = engine.sequence(f"streaming-{len(PROMPT)}")
    assert state.staged_tokens == 16 and engine.kv_bytes_in_use >= state.cache.nbytes + 16 * bytes_per_token


def test_whole_prompt_tokens_must_not_be_negative(decoder):
    with pytest.raises(ValueError, match="whole_prompt_tokens"):
        Engine(decoder, EngineConfig(whole_prompt_tokens=-1))


def test_kvpop_prompts_entering_whole_in_pieces_answer_as_in_one_call(tiny_onnx_model_dir):
    """The learned scorer and the question's pick on prompts that enter whole: cut into pieces by a step
    budget (the pieces written into one buffer of the prompt's length), several prompts' pieces batched in
    one call, or each prompt in one call: the same tokens and the same evictions."""
    prompts = [PROMPT, PROMPT[:1] + PROMPT[5:], [0] + [int(token) for token in rng.integers(3, 250, size=71)]]
    config = CacheConfig(policy="kvpop", budget=24, options=dict(sinks=2, window=4, scorer="mlstm", query_window=8))

    def run(**engine_config) -> list:
        engine = Engine.from_model_dir(tiny_onnx_model_dir, EngineConfig(whole_prompt_tokens=4096, **engine_config))
        requests = [GenerationRequest(f"p{index}", prompt, SamplingParams(max_tokens=10, ignore_eos=True), config)
                    for index, prompt in enumerate(prompts)]
        return [(result.output_ids, result.tokens_evicted) for result in engine.generate(requests)]

    one_call = run(prefill_chunk=256, max_batch_size=1)
    assert run(prefill_chunk=256, max_step_tokens=7, max_batch_size=1) == one_call  # pieces of 7 tokens
    assert run(prefill_chunk=256, max_step_tokens=24, max_batch_size=3) == one_call  # pieces beside running streams
    assert run(prefill_chunk=256, max_batch_size=3) == one_call  # prompts batched where their pieces line up
