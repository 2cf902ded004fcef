"""Where an engine step's milliseconds go (a program, not a test): one request, and a loaded period.

    python -m kvpop_eval.bench.engine profile --model build/bench/reference --out build/results/profile/profile_engine.json

Wraps the engine's parts in timers (the ONNX decoder call and what it copies back, the policy's
`observe` with the learned scorer inside it, the slot cache's eviction, the batch pool's repacks,
sampling) and runs the real `Engine.step` loop:
  * one request: a 2048-token prompt, 32 greedy output tokens, alone;
  * a loaded period: 8 streams of 512-token prompts decoding while 4 more 2048-token prompts arrive
    (the moment running streams stall behind prompt prefill), every request 32 output tokens;
  * chat: 8 short chat prompts of 100 tokens, 32 output tokens each (bench-service's (d) in the
    engine alone; a bounded cache of 16 slots, its prompt in --min-chunk pieces);
  * with --reason-tokens N: --reason-streams prompts (8) of --reason-prompt-tokens (512), N output tokens
    each (bench-service's (b); with 16 or 32 streams, the many users of (c));
  * prefill: 4 prompts of 1,750 tokens, 32 output tokens each (bench-service-real's prefill-heavy work:
    where the prompt's entry into a bounded cache shows).
--scenarios picks some of them (one, loaded, chat, reasoning, prefill). The engine is configured as the
service's CPU config is (whole-prompt prefill up to --whole-prompt-tokens, chunks of at least --min-chunk).
For each it prints a table (component, ms, share of the wall time) and the longest gap between two
tokens of an already running stream against its median gap. Timers nest: `decoder` includes its
own output copy; `policy.observe` includes `scorer`. The learned scorer takes a prompt's pieces in on its
own thread beside the decoder (kvpop.policies.kvpop.runtime): its ONNX time there overlaps the decoder's,
and what the engine waits for shows as "waiting for its thread".
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from kvpop.cache import pool as pool_module
from kvpop.cache import slot_cache as slot_cache_module
from kvpop.cache.manager import CacheManager
from kvpop.cache.staging import PromptStaging
from kvpop.engine import Engine
from kvpop.request import CacheConfig, GenerationRequest, SamplingParams
from kvpop_eval.engine_factory import build_engine
from kvpop.decoder import DecoderStep
from kvpop.policies.kvpop import KVpopPolicy, query
from kvpop.policies.kvpop.runtime import LearnedScorer, ScorerState
from kvpop_eval.provenance import stamp

DECODER_TIMER = "decoder (ONNX run + outputs to host)"
TIMERS: dict[str, float] = defaultdict(float)
CPU_TIMERS: dict[str, float] = defaultdict(float)  # the process's CPU seconds (every thread): steadier on a shared machine
CALLS: dict[str, int] = defaultdict(int)


@contextmanager
def timer(name: str):
    start, cpu = time.perf_counter(), time.process_time()
    try:
        yield
    finally:
        TIMERS[name] += time.perf_counter() - start
        CPU_TIMERS[name] += time.process_time() - cpu
        CALLS[name] += 1


def wrap(owner, attribute: str, name: str) -> None:
    original = getattr(owner, attribute)

    def timed(*args, **kwargs):
        with timer(name):
            return original(*args, **kwargs)

    setattr(owner, attribute, timed)


_CLASSES_WRAPPED = []


def instrument(engine: Engine) -> None:
    """Timers around the parts of a step (class attributes once, so every sequence's objects are covered)."""
    wrap(engine.decoder, "_run", DECODER_TIMER)  # every call: prefill, decode, mixed
    wrap(engine.runner, "mixed", "  decode step + prompt piece in one mixed call (incl. their stores)")
    if not _CLASSES_WRAPPED:
        wrap(slot_cache_module.SlotCache, "append", "cache.append (policy + writes)")
        wrap(KVpopPolicy, "observe", "  kvpop policy.observe (incl. scorer)")
        wrap(slot_cache_module.SlotCache, "_write_evicting", "  cache eviction (top-k + overwrite)")
        wrap(pool_module.BatchSlotPool, "bind", "batch pool bind/repack")
        wrap(CacheManager, "store_decode", "decode appends (kvpop: vectorised, incl. scorer)")
        wrap(PromptStaging, "inputs", "prompt pieces: past arrays (cache + staged pieces)")
        wrap(PromptStaging, "store", "prompt pieces: stored, staged, appended (incl. the prompt's eviction)")
        wrap(KVpopPolicy, "stage", "  kvpop policy.stage (the scorer over a staged piece)")
        wrap(LearnedScorer, "take_piece", "    learned scorer: a piece's rows handed to its thread")
        wrap(ScorerState, "settle", "    learned scorer: waiting for its thread (the part not hidden)")
        wrap(query, "pick", "    the question's pick (query.pick)")
        _CLASSES_WRAPPED.append(True)
    for scorer in engine.policy_assets.get("kvpop", {}).values():
        wrap(scorer.runtime, "step", "    learned scorer ONNX (a prompt's pieces: on its own thread)")
        wrap(scorer.runtime, "step_decode_batch", "  learned scorer decode graph (B sequences a call)")


def prompt(rng: np.random.Generator, tokens: int, vocab: int) -> list[int]:
    return [int(token) for token in rng.integers(3, vocab, size=tokens)]


# kvpop's size: 88% (a short chat then has no long-range slot: no scorer runs); `--kvpop-budget N`: N slots.
KVPOP_SIZE: dict = {"compression": 0.88}


def request(name: str, ids: list[int], policy: str, max_tokens: int) -> GenerationRequest:
    cache = CacheConfig(policy="full") if policy == "full" else CacheConfig(policy="kvpop", **KVPOP_SIZE, options=dict(scorer="mlstm", window=16))
    return GenerationRequest(name, ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True), cache)


def run_scenario(engine: Engine, arrivals: list[tuple[int, GenerationRequest]]) -> dict:
    """Drive `engine.step` until every request ends; `arrivals` are (step index, request)."""
    TIMERS.clear()
    CPU_TIMERS.clear()
    CALLS.clear()
    token_times: dict[str, list[float]] = defaultdict(list)
    pending = sorted(arrivals, key=lambda item: item[0])
    step_index, unfinished = 0, {req.request_id for _, req in arrivals}
    late = {req.request_id for at, req in arrivals if at > 0}
    first_late_arrival = None
    start = time.perf_counter()
    while unfinished:
        while pending and pending[0][0] <= step_index:
            if pending[0][0] > 0 and first_late_arrival is None:
                first_late_arrival = time.perf_counter()
            engine.add_request(pending.pop(0)[1])
        with timer("engine.step (wall)"):
            events = engine.step()
        now = time.perf_counter()
        for event in events:
            token_times[event.request_id].append(now)
            if event.finished:
                unfinished.discard(event.request_id)
                engine.result(event.request_id)
        step_index += 1
    wall = time.perf_counter() - start
    gaps_all, worst_ratio = [], 0.0
    for request_id, times in token_times.items():
        if request_id in late or len(times) < 3:
            continue
        gaps = np.diff(times)
        gaps_all.extend(gaps)
        if first_late_arrival is not None:
            worst_ratio = max(worst_ratio, float(gaps.max() / np.median(gaps)))
    return {
        "wall_ms": wall * 1e3,
        "steps": step_index,
        "components_ms": {name: TIMERS[name] * 1e3 for name in TIMERS},
        "components_cpu_ms": {name: CPU_TIMERS[name] * 1e3 for name in CPU_TIMERS},
        "calls": dict(CALLS),
        "running_stream_gap_ms": {
            "median": float(np.median(gaps_all)) * 1e3 if gaps_all else None,
            "max": float(np.max(gaps_all)) * 1e3 if gaps_all else None,
            "max_over_median": worst_ratio or None,
        },
    }


def scenarios(vocab: int, policy: str, reason_tokens: int = 0, reason_streams: int = 8,
              reason_prompt_tokens: int = 512, prefill_streams: int = 4) -> dict[str, list[tuple[int, GenerationRequest]]]:
    rng = np.random.default_rng(0)
    one = [(0, request("one", prompt(rng, 2048, vocab), policy, 32))]
    loaded = [(0, request(f"stream{i}", prompt(rng, 512, vocab), policy, 64)) for i in range(8)]
    loaded += [(12, request(f"long{i}", prompt(rng, 2048, vocab), policy, 32)) for i in range(4)]
    chat = [(0, request(f"chat{i}", prompt(rng, 100, vocab), policy, 32)) for i in range(8)]
    found = {"one request (2048 prompt, 32 out)": one, "loaded (8 streams + 4 x 2048 arriving)": loaded,
             "chat (8 x 100 prompt, 32 out)": chat}
    if reason_tokens:  # bench-service's workload (b) in the engine alone
        reasoning = [(0, request(f"reason{i}", prompt(rng, reason_prompt_tokens, vocab), policy, reason_tokens))
                     for i in range(reason_streams)]
        found[f"reasoning ({reason_streams} x {reason_prompt_tokens} prompt, {reason_tokens} out)"] = reasoning
    found[f"prefill ({prefill_streams} x 1750 prompt, 32 out)"] = [(0, request(f"prefill{i}", prompt(rng, 1750, vocab), policy, 32))
                                                              for i in range(prefill_streams)]
    return found


def table(results: dict) -> str:
    lines = []
    for label, by_policy in results.items():
        lines.append(f"\n### {label}\n")
        policies = list(by_policy)
        lines.append("| component | " + " | ".join(f"{p} ms | {p} share | {p} CPU ms" for p in policies) + " |")
        lines.append("|---|" + "---|---|---|" * len(policies))
        names = []
        for result in by_policy.values():
            names += [name for name in result["components_ms"] if name not in names]
        for name in names:
            cells = []
            for result in by_policy.values():
                ms = result["components_ms"].get(name, 0.0)
                cells.append(f"{ms:.1f} | {ms / result['wall_ms']:.0%} | {result['components_cpu_ms'].get(name, 0.0):.1f}")
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        cells = [f"{r['wall_ms']:.1f} | 100% | {r['components_cpu_ms'].get('engine.step (wall)', 0.0):.1f}" for r in by_policy.values()]
        lines.append("| **wall** | " + " | ".join(cells) + " |")
        gaps = [r["running_stream_gap_ms"] for r in by_policy.values()]
        if gaps[0]["median"] is not None:
            cells = [f"{g['median']:.1f} / {g['max']:.1f} ms ({g['max_over_median'] or 0:.1f}x) | | " for g in gaps]
            lines.append("| running streams' token gap median / max | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvpop_eval.bench.engine profile", description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help="exported model directory")
    parser.add_argument("--out", type=Path, help="JSON to write (a .md table is written beside it)")
    parser.add_argument("--prefill-chunk", type=int, default=256)
    parser.add_argument("--policies", nargs="+", default=["full", "kvpop"])
    parser.add_argument("--prefill-pacing", type=float, default=0.0,
                        help="the service's prefill_pacing (kvpop.engine.prefill_pacer); 0: one chunk per step")
    parser.add_argument("--reason-tokens", type=int, default=0,
                        help="also run --reason-streams prompts of 512 tokens with this many output tokens each (workload (b))")
    parser.add_argument("--reason-streams", type=int, default=8, help="sequences of the reasoning scenario")
    parser.add_argument("--reason-prompt-tokens", type=int, default=512, help="prompt tokens of the reasoning scenario")
    parser.add_argument("--scenarios", nargs="+", choices=["one", "loaded", "chat", "reasoning", "prefill"],
                        default=["one", "loaded", "chat", "reasoning"])
    parser.add_argument("--prefill-streams", type=int, default=4, help="prompts of the prefill scenario")
    parser.add_argument("--whole-prompt-tokens", type=int, default=4096,
                        help="the service's whole_prompt_tokens (a bounded cache's prompt enters whole, then evicts)")
    parser.add_argument("--min-chunk", type=int, default=64, help="the service's min_prefill_chunk_tokens")
    parser.add_argument("--no-mixed", action="store_true",
                        help="run decode steps and prompt pieces in separate decoder calls even when the export has the mixed step")
    parser.add_argument("--kvpop-budget", type=int, default=None, help="kvpop at this many slots per head instead of 88%%")
    args = parser.parse_args(argv)
    if args.kvpop_budget is not None:
        KVPOP_SIZE.clear()
        KVPOP_SIZE["budget"] = args.kvpop_budget

    results: dict[str, dict] = defaultdict(dict)
    for policy in args.policies:
        engine = build_engine(
            args.model, decoder=DecoderStep(args.model, mixed=not args.no_mixed), max_batch_size=max(16, args.reason_streams),
            prefill_chunk=args.prefill_chunk, prefill_pacing=args.prefill_pacing or None, min_bounded_chunk=args.min_chunk,
            whole_prompt_tokens=args.whole_prompt_tokens,
        )
        instrument(engine)
        found = lambda: scenarios(engine.spec.vocab_size, policy, args.reason_tokens, args.reason_streams,  # noqa: E731
                                  args.reason_prompt_tokens, args.prefill_streams)
        for label, arrivals in found().items():
            if label.split()[0] not in args.scenarios:
                continue
            run_scenario(engine, found()[label][:1])  # warm up
            results[label][policy] = run_scenario(engine, arrivals)
    text = table(results)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(stamp({"model": str(args.model), "prefill_chunk": args.prefill_chunk, "prefill_pacing": args.prefill_pacing,
                                        "mixed_step": engine.decoder.has_mixed_step, "kvpop": KVPOP_SIZE,
                                        "reason_streams": args.reason_streams, "results": results}), indent=2) + "\n")
        args.out.with_suffix(".md").write_text(text.lstrip() + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
