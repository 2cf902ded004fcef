"""kvpop's own cost per token in the engine (a program, not a test): full vs kvpop with each learned
scorer, with the vectorised decode path on and off, and, where the model ships retrieval heads (the
default then lets the question pick, kvpop.policies.kvpop.query), without that pick: in one run with
interleaved repetitions.

    python -m kvpop_eval.bench.engine overhead --model build/bench/reference --out-dir build/results/overhead

Runs `Engine.generate` (no Triton) on B prompts of P random tokens generating N tokens each, every
system once per repetition, repetitions interleaved so a busy minute of a shared machine hits every
system alike; reports the median wall time and the ratio full / system (1.0: kvpop costs nothing
over the full cache). The prefill chunk floor is the service's (`min_prefill_chunk_tokens`).
Writes policy_overhead.json and policy_overhead.md into --out-dir.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import statistics
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable

import numpy as np

from kvpop.request import CacheConfig, GenerationRequest, SamplingParams
from kvpop_eval.engine_factory import build_engine
from kvpop_eval.provenance import stamp
from kvpop_eval.timing import medians


def systems(scorers: list[str], compression: float, budget: int | None = None,
            query_aware: tuple[str, ...] = ()) -> dict[str, tuple[CacheConfig, bool]]:
    """name -> (cache config, vectorised decode on); kvpop at `budget` slots per head when given, else
    at `compression` (a short prompt at 88% leaves no long-range slot: then no scorer runs). The scorers
    in `query_aware` (their model ships retrieval heads) also run with the question's pick off."""
    table = {"full": (CacheConfig(policy="full"), True)}
    for kind in scorers:
        size = {"budget": budget} if budget is not None else {"compression": compression}
        config = CacheConfig(policy="kvpop", **size, options=dict(scorer=kind))
        table[f"kvpop:{kind}"] = (config, True)
        table[f"kvpop:{kind} per-sequence"] = (config, False)
        if kind in query_aware:
            table[f"kvpop:{kind}+noquery"] = (replace(config, options=replace(config.options, query_window=0)), True)
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvpop_eval.bench.engine overhead", description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help="exported model directory with learned scorers")
    parser.add_argument("--out-dir", type=Path, default=Path("build/results/overhead"))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=100)
    parser.add_argument("--output-tokens", type=int, nargs="+", default=[32, 256])
    parser.add_argument("--compression", type=float, default=0.88)
    parser.add_argument("--budget", type=int, default=None, help="kvpop at this many slots per head instead of --compression")
    parser.add_argument("--min-chunk", type=int, default=64, help="the service's min_prefill_chunk_tokens")
    parser.add_argument("--repetitions", type=int, default=7)
    args = parser.parse_args(argv)

    probe = build_engine(args.model)
    query_aware = tuple(kind for kind, scorer in probe.policy_assets["kvpop"].items() if scorer.retrieval_heads is not None)
    table = systems(sorted(probe.policy_assets["kvpop"]), args.compression, args.budget, query_aware)
    engines = {}
    for name, (_, batched) in table.items():
        engines[name] = build_engine(args.model, max_batch_size=args.batch, min_bounded_chunk=args.min_chunk)
        engines[name].cache_manager.batch_decode = batched
    vocab = probe.spec.vocab_size
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, vocab, size=args.prompt_tokens).tolist() for _ in range(args.batch)]
    started, rows = time.time(), []
    for output_tokens in args.output_tokens:
        sampling = SamplingParams(max_tokens=output_tokens, ignore_eos=True)
        ids = itertools.count()

        def run(name: str) -> Callable[[], object]:
            return lambda: engines[name].generate([GenerationRequest(f"{name}-{next(ids)}", prompt, sampling, table[name][0])
                                                   for prompt in prompts])

        times = {name: seconds for name, (_, seconds) in medians({name: run(name) for name in engines}, args.repetitions,
                                                                   warmup=1).items()}
        full = statistics.median(times["full"])
        for name, samples in times.items():
            median = statistics.median(samples)
            rows.append({"output_tokens": output_tokens, "system": name, "median_s": median,
                         "full_over_system": full / median, "samples_s": samples})
            print(f"[policy-overhead] {output_tokens:5d} tokens  {name:28s} {median * 1e3:8.1f} ms  full/this {full / median:.2f}")
    report = {
        "measured": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started)), "wall_s": time.time() - started,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "load_average": os.getloadavg(),
        "model": str(args.model), "batch": args.batch, "prompt_tokens": args.prompt_tokens,
        "compression": None if args.budget else args.compression, "budget": args.budget, "min_chunk": args.min_chunk, "repetitions": args.repetitions, "rows": rows,
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "policy_overhead.json").write_text(json.dumps(stamp(report), indent=2) + "\n")
    lines = [
        f"Measured {report['measured']} on {report['machine']} (load average {report['load_average'][0]:.1f}); "
        f"model {args.model}; {args.batch} prompts of {args.prompt_tokens} tokens; kvpop at "
        f"{f'{args.budget} slots per head' if args.budget else f'{args.compression:.0%} compression'}; medians of {args.repetitions} interleaved repetitions.", "",
        "| generated tokens | system | median ms | full / system |", "|---|---|---|---|",
        *(f"| {row['output_tokens']} | {row['system']} | {row['median_s'] * 1e3:.1f} | {row['full_over_system']:.2f} |" for row in rows),
    ]
    (args.out_dir / "policy_overhead.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
