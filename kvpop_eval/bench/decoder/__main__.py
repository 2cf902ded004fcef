"""`python -m kvpop_eval.bench.decoder ...`: the speed harness (kvpop_eval.bench.decoder says what it measures)."""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

from kvpop.decoder import DecoderStep
from kvpop.policies.kvpop import load_learned_scorers
from kvpop.policies.kvpop.kinds import requested_learned_scorer
from kvpop.request import CacheConfig

from kvpop_eval.bench import decoder as package
from kvpop_eval.bench.decoder.contexts import bounded_config, cache_configs, check_context, random_prompt, warm_contexts
from kvpop_eval.bench.decoder.latency import memory_needed, time_point
from kvpop_eval.bench.decoder.memory import measure_memory
from kvpop_eval.bench.decoder.report import plot, ratios, speedup_lines
from kvpop_eval.bench.decoder.scorer_cost import overhead_lines, policy_overheads, scorer_notes, scratch_model_dir, time_scorer_calls
from kvpop_eval.provenance import stamp

FULL_RUN = dict(
    contexts=(512, 1024, 2048, 4096, 8192, 16384),
    budgets=(256, 512),
    batches=(1, 8),
    policies=("streaming",),  # at every budget
    extra_policies=("kvpop", "h2o"),  # at the first budget only (policy overhead vs streaming)
    decode_steps=16,
    warmup_steps=2,
    block=4,
    prefill_chunk=256,
    memory_tokens=4096,
    memory_budget=256,
    memory_policies=("kvpop",),
)
QUICK_RUN = dict(
    contexts=(64, 256),
    budgets=(16, 32),
    batches=(1, 2),
    policies=("streaming",),
    extra_policies=("kvpop",),
    decode_steps=4,
    warmup_steps=1,
    block=2,
    prefill_chunk=16,
    memory_tokens=256,
    memory_budget=16,
    memory_policies=("kvpop",),
)

def prepare_model(work: Path, quick: bool) -> tuple[Path, Path]:
    from export.pipeline import export_model

    if quick:
        from export.tiny_model import build_tiny_llama

        hf_dir = build_tiny_llama(work / "hf")
    else:
        from kvpop_eval.bench.bench_model import build_bench_llama

        hf_dir = build_bench_llama(work / "hf")
    export_model(hf_dir, work / "onnx")
    return work / "onnx", hf_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvpop_eval.bench.decoder", description=package.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="exported model directory (default: build kvpop_eval/bench/bench_model.py's random Llama)")
    parser.add_argument("--hf-model", type=Path, help="the Hugging Face directory it was exported from")
    parser.add_argument("--quick", action="store_true", help="tiny random model, short contexts: checks the plumbing")
    parser.add_argument("--contexts", help="comma-separated context lengths (multiples of the prefill chunk)")
    parser.add_argument("--budgets", help="comma-separated slot budgets")
    parser.add_argument("--batches", help="comma-separated batch sizes")
    parser.add_argument("--policies", help="comma-separated bounded policies to time at each budget")
    parser.add_argument("--extra-policies", help="comma-separated bounded policies to time at the first budget only")
    parser.add_argument("--decode-steps", type=int, help="timed decode steps per point (median reported)")
    parser.add_argument("--warmup-steps", type=int)
    parser.add_argument("--memory-tokens", type=int, help="generated length of the memory runs (0: skip)")
    parser.add_argument("--block", type=int, help="steps each system runs per interleaving round")
    parser.add_argument("--prefill-chunk", type=int, help="engine prefill chunk (contexts must be multiples)")
    parser.add_argument("--threads", type=int, default=1, help="onnxruntime intra-op threads = torch threads")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--untrained-scorers-dir", type=Path, help="time a copy of --model built here, with an initialised (untrained) "
                        "scorer of the model's shape for each kvpop:<kind> the model lacks")
    parser.add_argument("--scorer-window", type=int, default=64, help="protected window of such untrained scorers")
    parser.add_argument("--out-dir", type=Path, default=Path("build/results/speed"))
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kvpop-speed-") as work:  # a random model and scratch scorers, gone after
        return run(args, Path(work))


def run(args: argparse.Namespace, work: Path) -> int:
    import psutil

    began = time.perf_counter()
    plan = dict(QUICK_RUN if args.quick else FULL_RUN)
    for key in ("contexts", "budgets", "batches"):
        if getattr(args, key):
            plan[key] = tuple(int(value) for value in getattr(args, key).split(","))
    for key in ("policies", "extra_policies"):
        if getattr(args, key) is not None:
            plan[key] = tuple(value for value in getattr(args, key).split(",") if value)
    for key in ("decode_steps", "warmup_steps", "memory_tokens", "prefill_chunk", "block"):
        if getattr(args, key) is not None:
            plan[key] = getattr(args, key)
    plan["threads"] = args.threads
    random_weights = args.model is None
    if args.model is None:
        args.model, args.hf_model = prepare_model(work, args.quick)
    configs = cache_configs(plan["budgets"], plan["policies"], plan["extra_policies"])
    memory_configs = {"full": CacheConfig(policy="full")}
    for policy in plan["memory_policies"]:
        memory_configs[f"{policy}-{plan['memory_budget']}"] = bounded_config(policy, plan["memory_budget"])
    kinds = {requested_learned_scorer(cache) for cache in (*configs.values(), *(memory_configs.values() if plan["memory_tokens"] else ()))} - {None}
    if kinds and (random_weights or args.untrained_scorers_dir):
        args.model = scratch_model_dir(args.model, args.untrained_scorers_dir or work / "scorers", kinds, args.scorer_window)
    learned_scorers = load_learned_scorers(args.model) if kinds else {}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)

    decoder = DecoderStep(args.model, threads=args.threads)
    spec = decoder.spec
    hf_model = None
    if args.hf_model and not args.skip_hf:
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(args.threads)
        hf_model = AutoModelForCausalLM.from_pretrained(args.hf_model, dtype=torch.float32).eval()
    model_note = (
        f"{spec.architecture}: {spec.num_layers} layers, {spec.num_attention_heads}/{spec.num_kv_heads} heads (GQA), "
        f"head_dim {spec.head_dim}, vocab {spec.vocab_size}, fp32"
        + (f", {sum(p.numel() for p in hf_model.parameters()) / 1e6:.1f}M params" if hf_model is not None else "")
        + (("; tiny random model" if args.quick else "; RANDOM weights (speed only)") if random_weights else f"; weights of {args.hf_model or args.model}")
        + ("; UNTRAINED learned scorers (speed only)" if any(not note["trained"] for note in scorer_notes(args.model, kinds).values()) else "")
        + f"; CPU, {args.threads} thread(s)"
    )
    print(model_note, flush=True)
    report = {
        "model": str(args.model),
        "model_note": model_note,
        "model_spec": {k: getattr(spec, k) for k in ("num_layers", "num_attention_heads", "num_kv_heads", "head_dim", "vocab_size", "max_position_embeddings", "dtype")},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "processor": platform.processor(), "load_average_at_start": os.getloadavg()},
        "plan": plan,
        "method": "warm prefixes of one real prefill (to max context) per cache config, grown context by context (Engine.warm_prefix); batch rows start from copies and compute one more prompt token; HF generate continues from a DynamicCache with the same tokens; systems interleaved in blocks of `block` steps; medians of timed steps after warmup",
        "decode": [],
        "memory": {},
        "checks": {},
        "learned_scorers": scorer_notes(args.model, kinds),
    }
    prompt = random_prompt(spec.vocab_size, max(plan["contexts"]) + 1)  # each point's requests add one token to the context
    states = {}
    for name, cache in configs.items():
        start = time.perf_counter()
        states[name] = warm_contexts(decoder, cache, prompt, plan["contexts"], plan["prefill_chunk"], learned_scorers)
        smallest = min(plan["contexts"])
        diff = check_context(decoder, cache, prompt, states[name][smallest], plan["prefill_chunk"], learned_scorers)
        report["checks"][f"{name}: warm prefix vs a cold Engine.prefill max |key diff| at {smallest}"] = diff
        report["prefill_s"] = {**report.get("prefill_s", {}), name: time.perf_counter() - start}
        print(f"prefill {name:14s} {max(plan['contexts'])} tokens in {time.perf_counter() - start:6.1f} s (check vs a cold prefill {diff:.1e})", flush=True)

    decoder = DecoderStep(args.model, threads=args.threads)  # fresh sessions: onnxruntime keeps the prefill's (large) arena
    # Longest context first: its largest batch needs the most memory, and the process holds the least
    # then (the decoder's onnxruntime arena, for one, only grows).
    for context in sorted(plan["contexts"], reverse=True):
        for batch in plan["batches"]:
            needed, available = memory_needed(spec, context, batch), psutil.virtual_memory().available
            if needed + 2 * 2**30 > available:  # never push a shared machine into its OOM killer
                report["skipped"] = [*report.get("skipped", []), {"context": context, "batch": batch, "needed_bytes": needed, "available_bytes": available}]
                print(f"ctx {context:6d} batch {batch} SKIPPED: needs ~{needed / 2**30:.1f} GiB, {available / 2**30:.1f} GiB available", flush=True)
                continue
            point = {name: states[name][context] for name in configs}
            rows = time_point(decoder, point, configs, hf_model, prompt, batch, plan["decode_steps"], plan["warmup_steps"], plan["block"], learned_scorers)
            for name, row in rows.items():
                report["decode"].append({"system": name, "batch": batch, "context": context, **row})
                print(f"ctx {context:6d} batch {batch} {name:14s} {row['ms_per_token']:8.2f} ms/token {row['tokens_per_s']:8.1f} tok/s  step {1000 * row['step_latency_s']:8.2f} ms (p90 {1000 * row['step_latency_p90_s']:.1f})", flush=True)
        for name in configs:  # this context's states are no longer needed
            states[name].pop(context)
        (args.out_dir / "speed.partial.json").write_text(json.dumps(report, indent=2) + "\n")  # survives a crash later on
    report["ratios"] = ratios(report)
    report["policy_overhead"] = policy_overheads(report)
    report["scorer_calls"] = time_scorer_calls(learned_scorers, kinds, spec, plan["batches"])

    if plan["memory_tokens"]:
        for name, cache in memory_configs.items():
            samples = measure_memory(args.model, cache, plan["memory_tokens"], args.threads)
            report["memory"][name] = samples
            first, last = samples[0], samples[-1]
            print(
                f"memory {name:14s}: generated {first['generated']}->{last['generated']}: KV {first['kv_bytes'] / 2**20:.2f}->{last['kv_bytes'] / 2**20:.2f} MiB, "
                f"peak RSS {first['peak_rss_bytes'] / 2**20:.0f}->{last['peak_rss_bytes'] / 2**20:.0f} MiB",
                flush=True,
            )
    report["speedups_at_8k"] = speedup_lines(report)
    report["kvpop_overhead_at_8k"] = overhead_lines(report)
    report["wall_s"] = time.perf_counter() - began
    (args.out_dir / "speed.json").write_text(json.dumps(stamp(report), indent=2) + "\n")
    (args.out_dir / "speed.partial.json").unlink(missing_ok=True)
    plot(report, args.out_dir)
    print("\n".join(report["speedups_at_8k"] + report["kvpop_overhead_at_8k"]))
    print(f"wrote {args.out_dir}/speed.json, decode_speed.png{', memory.png' if report['memory'] else ''} in {report['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
