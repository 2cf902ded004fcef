"""Decode latency at one (context, batch): the engine's configurations and HF `generate`, interleaved.

Medians over the timed steps after untimed warm-up ones (the first decode step repacks the batch pool
and, for `full`, grows the cache by a block). HF `generate` is given a DynamicCache holding the same C
keys/values as the full cache's state (the exported step's keys are HF's post-RoPE keys; parity is
checked at export) and the prompt, so it processes only the new tokens; its per-step time is taken
between successive logits-processor calls.
"""

from __future__ import annotations

import gc
import statistics
import time

import numpy as np

from kvpop.cache.prefix_cache import PrefixCache
from kvpop.engine import Engine, EngineConfig
from kvpop.request import GenerationRequest, SamplingParams
from kvpop.sessions import SessionState


def summarize(latencies: list[float], batch: int) -> dict:
    median = statistics.median(latencies)
    return {
        "step_latency_s": median,
        "ms_per_token": 1000 * median / batch,
        "tokens_per_s": batch / median,
        "step_latency_mean_s": statistics.fmean(latencies),
        "step_latency_p90_s": float(np.percentile(latencies, 90)),
        "steps_timed": len(latencies),
    }


class Clock:
    """A logits processor that only timestamps: HF generate calls it once per generated token."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def __call__(self, input_ids, scores):
        self.stamps.append(time.perf_counter())
        return scores


def hf_cache_from_state(state: SessionState, batch: int):
    """A DynamicCache (HF's default) holding a full cache state's C tokens for `batch` rows."""
    import torch
    from transformers import DynamicCache

    cache = state
    length = cache.length
    assert np.array_equal(cache.position[0, 0, :length], np.arange(length)), "full cache slots are in order"
    past = DynamicCache()
    for layer in range(cache.key.shape[0]):
        key = torch.from_numpy(np.ascontiguousarray(cache.key[layer, :, :length]))[None].repeat(batch, 1, 1, 1)
        value = torch.from_numpy(np.ascontiguousarray(cache.value[layer, :, :length]))[None].repeat(batch, 1, 1, 1)
        past.update(key, value, layer)
    return past


def hf_generate_block(model, base_cache, ids, tokens: int) -> list[float]:
    """Continue HF generate (greedy, DynamicCache) from `base_cache` for `tokens` decode steps, then
    crop the cache back to its C tokens (no copy of the cache: at 8k x batch 8 it is 3 GiB); returns
    each step's time (between successive logits-processor calls)."""
    import torch
    from transformers import LogitsProcessorList

    length = base_cache.get_seq_length()
    clock = Clock()
    new_tokens = tokens + 1
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            past_key_values=base_cache,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=model.config.pad_token_id,
            logits_processor=LogitsProcessorList([clock]),
        )
    base_cache.crop(length - base_cache.get_seq_length())  # negative: drop the generated tokens
    assert out.shape[1] == ids.shape[1] + new_tokens
    return np.diff(clock.stamps).tolist()


def time_point(decoder, states: dict, configs: dict, hf_model, prompt, batch: int, steps: int, warmup: int, block: int,
               learned_scorers: dict) -> dict:
    """Median decode step time of every system at one (context C, batch B), measured INTERLEAVED: in
    each round every engine configuration runs `block` steps and HF generate runs `block` steps, so
    load from other processes on a shared machine hits all systems alike. Each engine's B requests
    start from copies of the configuration's C-token state (`states`, a warm prefix) and compute the
    prompt's one more token before they decode; HF generate does the same from its DynamicCache."""
    context = states["full"].tokens_seen
    engines = {}
    for name, cache in configs.items():
        engine = Engine(decoder, EngineConfig(max_batch_size=batch), policy_assets={"kvpop": learned_scorers}, prefixes=warm(states[name]))
        sampling = SamplingParams(max_tokens=warmup + steps + block + 2, ignore_eos=True)
        for index in range(batch):
            engine.add_request(GenerationRequest(f"b{index}", prompt[: context + 1], sampling, cache))
        engine.step()  # admits everyone: copies of the warm prefix, the last prompt token, the first output
        for _ in range(warmup):  # first steps: pool repack, full-cache block growth
            engine.step()
        engines[name] = engine
    latencies: dict[str, list[float]] = {name: [] for name in engines}
    hf_base = hf_ids = None
    if hf_model is not None:
        import torch

        hf_base = hf_cache_from_state(states["full"], batch)
        hf_ids = torch.tensor([prompt[: context + 1]] * batch)
        hf_generate_block(hf_model, hf_base, hf_ids, warmup)
        latencies["hf-generate"] = []
    while len(latencies["full"]) < steps:
        for name, engine in engines.items():
            for _ in range(block):
                start = time.perf_counter()
                events = engine.step()
                latencies[name].append(time.perf_counter() - start)
                assert len(events) == batch and not any(event.finished for event in events), "a sequence stopped early"
        if hf_model is not None:
            latencies["hf-generate"].extend(hf_generate_block(hf_model, hf_base, hf_ids, block))
    rows = {}
    spec = decoder.spec
    for name, values in latencies.items():
        if name == "hf-generate":
            kv_bytes = 2 * spec.num_layers * batch * spec.num_kv_heads * context * spec.head_dim * decoder.dtype.itemsize
            rows[name] = {**summarize(values, batch), "kv_bytes": kv_bytes}
        else:
            # Whether the decode steps took the vectorised kvpop path (kvpop.policies.kvpop.decode_batch).
            engine = engines[name]
            caches = [engine.sequence(request_id).cache for request_id in engine.state().decoding]
            vectorised = all(cache.policy.decode_group(cache) is not None for cache in caches)
            rows[name] = {**summarize(values, batch), "kv_bytes": engine.kv_bytes_in_use,
                          "cache_slots": engine.cache_manager.pool.slots, "vectorised_decode": vectorised}
    del engines, hf_base
    gc.collect()  # a pool and its bound caches refer to each other: free them now, not at some later gc
    return rows


def warm(state: SessionState) -> PrefixCache:
    """A prefix cache holding `state` alone: what a point's engine starts its requests from."""
    prefixes = PrefixCache()
    prefixes.add(state)
    return prefixes


def memory_needed(spec, context: int, batch: int) -> int:
    """Bytes a point needs at its peak beyond what the process holds, in units of the B sequences'
    full cache (KV): the full engine's pool while a growth by one block packs a new pool from new
    caches (3 KV, in warm-up), or its pool beside HF's cache and the grown copy its DynamicCache
    concatenates each step (3 KV), plus the runtimes' working memory (SmolLM2 at 8k x 8: 2.8 GB of
    KV, the process grew by 10.7 GB)."""
    kv = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * np.dtype(spec.dtype).itemsize * (context + 64) * batch
    return 4 * kv
