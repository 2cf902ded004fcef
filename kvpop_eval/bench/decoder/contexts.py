"""The decode contexts a speed point starts from, and why they are the state a real prefill leaves.

For every cache configuration ONE prompt of max(contexts) tokens is prefilled by the engine, as warm
prefixes growing context by context (`Engine.warm_prefix`): each is prefilled from the longest one
already kept, so the prompt is prefilled once in all, and a bounded cache's prefix is exactly where a
cold prefill of a longer prompt stands after the same chunks (kvpop.cache.prefix_cache; checked here
against a cold `Engine.prefill` at the smallest context). A decode point at context C and batch B
then runs the real engine (`Engine.step`: batch pool, policy bookkeeping, sampling) over B requests
whose prompt is the C-token prefix and one token more: each starts from a copy of the prefix's state
and computes that token (a prefix is reused only when a prompt token is left to give the first output's
logits), so it decodes from C + 1 cached tokens; a `full` cache at a multiple of the growth block then
holds one block more storage than at C.
Decode cost does not depend on the cached values, so the copies time the same work as B independent
prompts would, without paying B x (contexts x configs) prefills on a 2-core machine.
"""

from __future__ import annotations

import numpy as np

from kvpop.cache.prefix_cache import PrefixCache
from kvpop.decoder import DecoderStep
from kvpop.engine import Engine, EngineConfig
from kvpop.policies.kvpop.kinds import LEARNED_SCORER_KINDS
from kvpop.request import CacheConfig, GenerationRequest, SamplingParams
from kvpop.sessions import SessionState


def random_prompt(vocab: int, tokens: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(3, vocab, size=tokens).tolist()


def bounded_config(policy: str, budget: int) -> CacheConfig:
    """`policy` is a policy name, or `kvpop:<learned kind>` (the window is then the scorer's own)."""
    policy, _, scorer = policy.partition(":")
    if scorer and (policy != "kvpop" or scorer not in LEARNED_SCORER_KINDS):
        raise ValueError(f"a scorer is named as kvpop:<kind> with kind in {LEARNED_SCORER_KINDS}, got {policy}:{scorer}")
    extra = {"scorer": scorer} if scorer else {}
    return CacheConfig(policy=policy, budget=budget, options=dict(sinks=4, window=min(64, budget // 4), **extra))


def cache_configs(budgets: tuple[int, ...], policies: tuple[str, ...], extra_policies: tuple[str, ...] = ()) -> dict[str, CacheConfig]:
    configs = {"full": CacheConfig(policy="full")}
    for policy in policies:
        for budget in budgets:
            configs[f"{policy}-{budget}"] = bounded_config(policy, budget)
    for policy in extra_policies:
        configs[f"{policy}-{budgets[0]}"] = bounded_config(policy, budgets[0])
    return configs


def warm_contexts(decoder: DecoderStep, cache: CacheConfig, prompt: list[int], contexts, prefill_chunk: int,
                  learned_scorers: dict) -> dict[int, SessionState]:
    """The cache state after each context's first tokens of `prompt`: warm prefixes of one engine,
    each prefilled from the one before (the prompt is prefilled once)."""
    prefixes = PrefixCache()
    engine = Engine(decoder, EngineConfig(max_batch_size=1, prefill_chunk=prefill_chunk), policy_assets={"kvpop": learned_scorers},
                    prefixes=prefixes)
    for context in sorted(contexts):
        if engine.warm_prefix(prompt[:context], cache) != context:
            raise ValueError(f"context {context} is not a multiple of the prefill chunk ({prefill_chunk}, or the budget)")
    return {state.tokens_seen: state for state in prefixes}


def check_context(decoder: DecoderStep, cache: CacheConfig, prompt: list[int], state: SessionState, prefill_chunk: int,
                  learned_scorers: dict) -> float:
    """The warm prefix equals what a cold `Engine.prefill` of the same tokens leaves (max |key diff|)."""
    engine = Engine(decoder, EngineConfig(max_batch_size=1, prefill_chunk=prefill_chunk), policy_assets={"kvpop": learned_scorers})
    theirs = engine.prefill(GenerationRequest("check", prompt[: state.tokens_seen], SamplingParams(max_tokens=1), cache)).cache
    try:
        assert state.length == theirs.length and state.tokens_seen == theirs.tokens_seen
        assert np.array_equal(state.position[..., : state.length], theirs.position[..., : theirs.length])
        return float(np.abs(state.key[:, :, : state.length] - theirs.key[:, :, : theirs.length]).max())
    finally:
        engine.free("check")
