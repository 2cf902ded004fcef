"""The speed harness reaches its decode contexts through the engine's public API: warm prefixes grown
context by context are the state a cold prefill leaves, and a point decodes from copies of them."""

from __future__ import annotations

from kvpop_eval.bench.decoder.contexts import cache_configs, check_context, random_prompt, warm_contexts
from kvpop_eval.bench.decoder.latency import time_point

CONTEXTS = (32, 64)


def test_every_context_is_the_state_a_cold_prefill_leaves_and_decodes_in_a_batch(decoder):
    prompt = random_prompt(decoder.spec.vocab_size, max(CONTEXTS) + 1)
    configs = cache_configs((16,), ("streaming",), ("h2o",))
    states = {name: warm_contexts(decoder, cache, prompt, CONTEXTS, 16, {}) for name, cache in configs.items()}
    for name, cache in configs.items():
        assert sorted(states[name]) == list(CONTEXTS)
        for state in states[name].values():
            assert check_context(decoder, cache, prompt, state, 16, {}) < 1e-5
    point = {name: states[name][64] for name in configs}
    rows = time_point(decoder, point, configs, None, prompt, batch=2, steps=2, warmup=1, block=1, learned_scorers={})
    assert set(rows) == set(configs) and all(row["steps_timed"] == 2 for row in rows.values())
    assert rows["streaming-16"]["kv_bytes"] < rows["full"]["kv_bytes"]
