"""The generation loop on the tiny exported model: HF parity, batching, sampling, stopping, threads."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

from kvpop.decoder import DecoderStep
from kvpop.engine import Engine, EngineConfig
from kvpop.request import CacheConfig, GenerationRequest, SamplingParams
from kvpop.policies import POLICIES
from kvpop.sampling import Sampler

REFERENCE_MODEL = Path(__file__).resolve().parents[2] / "models" / "reference"

PROMPTS = [[0, 5, 17, 99, 23, 41, 7, 64, 12, 200, 31], [0, 250, 3], [0, 9, 8, 7, 6, 5, 4, 3, 2, 101, 102, 103, 104, 105, 106, 107, 108, 109, 110]]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def tokenizer(tiny_onnx_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_onnx_model_dir / "tokenizer")


@pytest.fixture(scope="module")
def hf_greedy(tiny_hf_model_dir) -> list[list[int]]:
    import torch
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(tiny_hf_model_dir).eval()
    outputs = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = torch.tensor([prompt])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW_TOKENS,
                                 pad_token_id=model.config.pad_token_id)
            outputs.append(out[0, len(prompt):].tolist())
    return outputs


def cache_config(policy: str, budget: int | None, **options) -> CacheConfig:
    return CacheConfig(policy=policy, budget=None if policy == "full" else budget, options=dict(sinks=2, window=4, **options))


def requests(policy: str, budget: int | None, sampling: SamplingParams | None = None, tag: str = "") -> list[GenerationRequest]:
    sampling = sampling or SamplingParams(max_tokens=NEW_TOKENS)
    return [GenerationRequest(f"{tag}{policy}-{index}", prompt, sampling, cache_config(policy, budget))
            for index, prompt in enumerate(PROMPTS)]


@pytest.mark.parametrize("policy", list(POLICIES))
def test_every_policy_matches_hf_greedy_when_the_budget_holds_the_sequence(decoder, hf_greedy, policy):
    engine = Engine(decoder, EngineConfig(max_batch_size=8, prefill_chunk=4))  # chunked prefill, batched decode
    results = engine.generate(requests(policy, budget=64))
    assert [result.output_ids for result in results] == hf_greedy
    assert all(result.tokens_evicted == 0 for result in results)


def test_compression_zero_is_the_full_cache(decoder, hf_greedy):
    engine = Engine(decoder)
    config = CacheConfig(policy="kvpop", compression=0.0, options=dict(sinks=2, window=4))
    results = engine.generate([GenerationRequest(str(i), p, SamplingParams(max_tokens=NEW_TOKENS), config) for i, p in enumerate(PROMPTS)])
    assert [result.output_ids for result in results] == hf_greedy
    assert [result.budget for result in results] == [len(p) + NEW_TOKENS for p in PROMPTS]


@pytest.mark.parametrize("policy", list(POLICIES))
def test_batched_equals_alone_under_eviction(decoder, policy):
    batched = Engine(decoder, EngineConfig(max_batch_size=8, prefill_chunk=8)).generate(requests(policy, budget=10))
    alone = [Engine(decoder, EngineConfig(max_batch_size=1, prefill_chunk=8)).generate([request])[0] for request in requests(policy, budget=10)]
    assert [r.output_ids for r in batched] == [r.output_ids for r in alone]
    if policy != "full":
        assert all(r.budget == 10 and r.peak_kv_bytes == 10 * decoder.spec.kv_bytes_per_token for r in batched)
        assert batched[0].tokens_evicted == len(PROMPTS[0]) + NEW_TOKENS - 1 - 10


def test_mixed_policies_and_budgets_share_a_batch_and_join_in_flight(decoder):
    mixed = [GenerationRequest(f"m{i}", PROMPTS[i % 3], SamplingParams(max_tokens=10 + 3 * i), cache_config(policy, 6 + i))
             for i, policy in enumerate(POLICIES)]
    alone = [Engine(decoder).generate([request])[0].output_ids for request in mixed]
    engine = Engine(decoder, EngineConfig(max_batch_size=3))  # fewer slots than requests: later ones join as others finish
    engine.add_request(mixed[0])
    engine.step()
    for request in mixed[1:]:
        engine.add_request(request)
    while engine.has_unfinished():
        engine.step()
        assert engine.num_running <= 3
    assert [engine.result(request.request_id).output_ids for request in mixed] == alone


def test_device_resident_cache_gives_the_same_tokens_and_moves_only_written_slots(tiny_onnx_model_dir, decoder):
    """The IO-binding path (the cache kept in the decoder's device memory between steps, synced by
    scattering written slots) runs here on the CPU provider: same tokens as host arrays, for every
    policy in one batch with in-flight joins; a steady-state step uploads nothing whole."""
    resident = DecoderStep(tiny_onnx_model_dir, threads=1, resident=True)
    assert resident.device_store is not None and decoder.device_store is None  # CPU default: host arrays
    mixed = [GenerationRequest(f"r{i}", PROMPTS[i % 3], SamplingParams(max_tokens=12 + 2 * i), cache_config(policy, 7 + i))
             for i, policy in enumerate(POLICIES)]
    expected = Engine(decoder, EngineConfig(max_batch_size=3)).generate(mixed)
    got = Engine(resident, EngineConfig(max_batch_size=3)).generate(mixed)
    assert [r.output_ids for r in got] == [r.output_ids for r in expected]
    store = resident.device_store
    assert store.slot_writes > 0
    decode_steps = sum(len(r.output_ids) for r in got)
    assert store.uploads < decode_steps / 4  # whole uploads only when the batch changes


def test_seeded_sampling_is_reproducible_alone_and_batched(decoder):
    sampling = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=123, max_tokens=16)
    first = Engine(decoder).generate(requests("h2o", 10, sampling, tag="a"))
    again = Engine(decoder, EngineConfig(max_batch_size=1)).generate(requests("h2o", 10, sampling, tag="b"))
    assert [r.output_ids for r in first] == [r.output_ids for r in again]
    other_seed = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=124, max_tokens=16)
    assert Engine(decoder).generate(requests("h2o", 10, other_seed))[0].output_ids != first[0].output_ids


def test_sampler_limits_reduce_to_greedy():
    logits = np.random.default_rng(0).normal(size=50).astype(np.float32)
    assert Sampler(SamplingParams(temperature=2.0, top_k=1, seed=0))(logits) == int(logits.argmax())
    assert Sampler(SamplingParams(temperature=2.0, top_p=1e-6, seed=0))(logits) == int(logits.argmax())
    draws = {Sampler(SamplingParams(temperature=1.0, top_k=3, seed=s))(logits) for s in range(200)}
    assert draws == set(np.argsort(-logits)[:3].tolist())


def test_stops_on_eos_stop_string_and_max_tokens(decoder, tokenizer, hf_greedy):
    engine = Engine(decoder, tokenizer=tokenizer)
    greedy_text = tokenizer.decode(hf_greedy[0], skip_special_tokens=True)
    stop = greedy_text[len(greedy_text) // 2 : len(greedy_text) // 2 + 2]
    result = engine.generate([GenerationRequest("s", PROMPTS[0], SamplingParams(max_tokens=NEW_TOKENS, stop=(stop,)))])[0]
    assert result.finish_reason == "stop" and result.matched_stop == stop
    assert stop in tokenizer.decode(result.output_ids) and len(result.output_ids) < NEW_TOKENS
    assert result.output_ids == hf_greedy[0][: len(result.output_ids)]  # every generated token, the stop's too
    assert result.text == greedy_text[: greedy_text.index(stop)]  # the text ends before the stop string
    short = engine.generate([GenerationRequest("m", PROMPTS[0], SamplingParams(max_tokens=3))])[0]
    assert (short.output_ids, short.finish_reason) == (hf_greedy[0][:3], "length")
    eos = decoder.spec.eos_token_ids[0]
    forced = Engine(decoder)
    forced.spec = type(decoder.spec)(**{**decoder.spec.__dict__, "eos_token_ids": (hf_greedy[0][2],)})
    ended = forced.generate([GenerationRequest("e", PROMPTS[0], SamplingParams(max_tokens=NEW_TOKENS))])[0]
    assert ended.finish_reason == "stop" and ended.output_ids[-1] == hf_greedy[0][2] != eos


def test_cancel_and_add_from_another_thread(decoder):
    engine = Engine(decoder, EngineConfig(max_batch_size=2))
    engine.add_request(GenerationRequest("long", PROMPTS[0], SamplingParams(max_tokens=1000), cache_config("streaming", 8)))
    engine.add_request(GenerationRequest("queued", PROMPTS[1], SamplingParams(max_tokens=1000), cache_config("streaming", 8)))
    engine.add_request(GenerationRequest("never", PROMPTS[1], SamplingParams(max_tokens=5)))
    engine.step()
    adder = threading.Thread(target=lambda: [engine.add_request(GenerationRequest(f"t{i}", PROMPTS[2], SamplingParams(max_tokens=4))) for i in range(4)])
    adder.start()
    engine.cancel("long")
    engine.cancel("never")
    finished = {}
    while engine.has_unfinished() or adder.is_alive():
        for event in engine.step():
            if event.finished:
                finished[event.request_id] = event.finish_reason
        if "t3" in finished:
            engine.cancel("queued")
    adder.join()
    assert finished["long"] == finished["never"] == finished["queued"] == "cancelled"
    assert all(finished[f"t{i}"] == "length" for i in range(4))
    assert engine.result("never").output_ids == [] and engine.kv_bytes_in_use == 0
    with pytest.raises(KeyError, match="unknown"):
        engine.result("never")


def test_a_request_cancelled_mid_prefill_stops_and_frees_its_kv(decoder):
    engine = Engine(decoder, EngineConfig(prefill_chunk=4, max_step_tokens=4))
    engine.add_request(GenerationRequest("long", list(range(3, 83)), SamplingParams(max_tokens=8)))
    engine.step()
    engine.step()
    assert engine.state().prefilling == ("long",) and engine.kv_bytes_in_use > 0  # 8 of 80 prompt tokens in
    engine.cancel("long")
    events = engine.step()
    assert [(event.request_id, event.finish_reason) for event in events] == [("long", "cancelled")]
    assert engine.result("long").output_ids == [] and engine.kv_bytes_in_use == 0 and not engine.has_unfinished()


def test_bounded_memory_is_flat_in_generated_length(decoder):
    engine = Engine(decoder)
    peaks = [engine.generate([GenerationRequest(f"g{n}", PROMPTS[0], SamplingParams(max_tokens=n), cache_config("kvpop", 16))])[0].peak_kv_bytes
             for n in (20, 200)]
    assert peaks[0] == peaks[1] == 16 * decoder.spec.kv_bytes_per_token
    full = [engine.generate([GenerationRequest(f"f{n}", PROMPTS[0], SamplingParams(max_tokens=n))])[0].peak_kv_bytes for n in (20, 200)]
    assert full[1] > full[0]


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: CacheConfig(policy="lru", budget=4), "registered: full, streaming, h2o"),
        (lambda: CacheConfig(policy="h2o"), "exactly one of budget"),
        (lambda: CacheConfig(policy="h2o", budget=4, compression=0.5), "exactly one of budget"),
        (lambda: CacheConfig(policy="full", budget=4), "neither budget nor compression"),
        (lambda: CacheConfig(policy="tova", compression=1.0), r"compression must be in \[0, 1\)"),
        (lambda: CacheConfig(policy="tova", budget=0), "positive whole number"),
        (lambda: CacheConfig(policy="kvpop", budget=8, options=dict(scorer="lstm")), "unknown kvpop scorer"),
        (lambda: SamplingParams(temperature=-1), "temperature"),
        (lambda: SamplingParams(top_p=0.0), "top_p"),
        (lambda: SamplingParams(max_tokens=0), "max_tokens"),
        (lambda: GenerationRequest("x", []), "prompt_ids is empty"),
    ],
)
def test_invalid_configuration_is_refused_with_a_clear_message(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_invalid_requests_are_refused_at_add(decoder):
    engine = Engine(decoder)
    with pytest.raises(ValueError, match="out of vocabulary"):
        engine.add_request(GenerationRequest("v", [0, 10**6]))
    with pytest.raises(ValueError, match="need an engine with a tokenizer"):
        engine.add_request(GenerationRequest("t", [0, 1], SamplingParams(stop=("x",))))
    engine.add_request(GenerationRequest("d", [0, 3]))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request(GenerationRequest("d", [0, 3]))


@pytest.mark.parametrize("kind", ["mlstm", "mlp"])
def test_learned_scorers_load_with_the_model_and_bound_the_cache(tiny_onnx_model_dir, hf_greedy, kind):
    engine = Engine.from_model_dir(tiny_onnx_model_dir, EngineConfig(prefill_chunk=4))
    assert set(engine.policy_assets["kvpop"]) == {"mlstm", "mlp"}
    roomy = CacheConfig(policy="kvpop", budget=64, options=dict(scorer=kind))
    results = engine.generate([GenerationRequest(f"{kind}-{i}", p, SamplingParams(max_tokens=NEW_TOKENS), roomy)
                               for i, p in enumerate(PROMPTS)])
    assert [result.output_ids for result in results] == hf_greedy
    tight = CacheConfig(policy="kvpop", budget=12, options=dict(sinks=2, scorer=kind))
    results = engine.generate([GenerationRequest(f"{kind}-tight-{i}", p, SamplingParams(max_tokens=NEW_TOKENS), tight)
                               for i, p in enumerate(PROMPTS)])
    assert all(result.budget == 12 and result.tokens_evicted == result.tokens_seen - 12 for result in results)


def test_a_learned_scorer_the_model_lacks_is_refused_at_add(decoder):
    engine = Engine(decoder)  # no learned scorers loaded
    with pytest.raises(ValueError, match="no learned kvpop scorer 'mlstm'"):
        engine.add_request(GenerationRequest("x", [0, 1], cache=CacheConfig(policy="kvpop", budget=8, options=dict(scorer="mlstm"))))


def test_every_policy_matches_hf_greedy_on_the_reference_model(reference_onnx_model_dir):
    """The same parity on the shipped model (other vocabulary, head_dim, tied embeddings)."""
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    from kvpop_tasks import TaskConfig, generate_task

    tokenizer = AutoTokenizer.from_pretrained(reference_onnx_model_dir / "tokenizer")
    prompts = [tokenizer(generate_task(TaskConfig(context_tokens=256), "test", index).prompt).input_ids for index in range(2)]
    model = LlamaForCausalLM.from_pretrained(REFERENCE_MODEL).eval()
    expected = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=12,
                                 pad_token_id=model.config.pad_token_id)
            expected.append(out[0, len(prompt):].tolist())
    engine = Engine(DecoderStep(reference_onnx_model_dir), EngineConfig(max_batch_size=8, prefill_chunk=64))
    for policy in POLICIES:
        config = CacheConfig(policy=policy, budget=None if policy == "full" else 512)
        results = engine.generate([GenerationRequest(f"{policy}-{i}", p, SamplingParams(max_tokens=12), config)
                                   for i, p in enumerate(prompts)])
        assert [result.output_ids for result in results] == expected, policy
