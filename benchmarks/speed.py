"""Speed harness (a program, not a test): decode speed and memory of the engine vs Hugging Face.

    python -m benchmarks.speed --model EXPORTED_DIR --hf-model HF_DIR --out-dir benchmarks/results
    python -m benchmarks.speed --quick --out-dir /tmp/speed   # tiny random model, seconds

1. Decode tokens/s and per-step latency vs context length for `full` vs fixed budgets (streaming
   and kvpop at each budget), at each batch size, and HF `generate` with its default dynamic cache
   on the same work, in one run.
2. Peak process memory and KV bytes vs generated length for `full` vs a bounded policy (each
   configuration in its own process, so peaks do not mix).
Writes speed.json, decode_speed.png, memory.png, and prints the speedups at the context nearest 8k.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from kvpop.decoder import DecoderStep
from kvpop.engine import CacheConfig, Engine, GenerationRequest, SamplingParams

FULL_RUN = dict(contexts=(512, 1024, 2048, 4096, 8192, 16384), budgets=(256, 512), batches=(1, 8), decode_steps=32, memory_tokens=8192, memory_budget=256)
QUICK_RUN = dict(contexts=(64, 256), budgets=(16, 32), batches=(1, 2), decode_steps=4, memory_tokens=256, memory_budget=16)


def random_prompts(vocab: int, batch: int, context: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return rng.integers(3, vocab, size=(batch, context)).tolist()


def cache_configs(budgets: tuple[int, ...], bounded_policies: tuple[str, ...]) -> dict[str, CacheConfig]:
    configs = {"full": CacheConfig(policy="full")}
    for budget in budgets:
        for policy in bounded_policies:
            configs[f"{policy}-{budget}"] = CacheConfig(policy=policy, budget=budget, sinks=4, window=min(64, budget // 4))
    return configs


def time_engine_decode(decoder: DecoderStep, cache: CacheConfig, batch: int, context: int, steps: int, prefill_chunk: int) -> dict:
    """Prefill `batch` prompts of `context` tokens, then time `steps` batched decode steps."""
    engine = Engine(decoder, max_batch_size=batch, prefill_chunk=prefill_chunk)
    sampling = SamplingParams(max_tokens=steps + 2, ignore_eos=True)
    for index, prompt in enumerate(random_prompts(decoder.spec.vocab_size, batch, context)):
        engine.add_request(GenerationRequest(f"b{index}", prompt, sampling, cache))
    start = time.perf_counter()
    engine.step()  # admits and prefills everyone
    prefill_s = time.perf_counter() - start
    latencies = []
    for _ in range(steps):
        start = time.perf_counter()
        events = engine.step()
        latencies.append(time.perf_counter() - start)
        assert len(events) == batch, "a sequence stopped early; raise max_tokens"
    kv_bytes = engine.kv_bytes_in_use
    while engine.has_unfinished():
        engine.step()
    median = statistics.median(latencies)
    return {"prefill_s": prefill_s, "step_latency_s": median, "tokens_per_s": batch / median, "kv_bytes": kv_bytes}


def time_hf_decode(model, batch: int, context: int, steps: int, vocab: int) -> dict:
    """HF `generate` (default cache): (time for 1 + steps new tokens - time for 1) / steps."""
    import torch

    ids = torch.tensor(random_prompts(vocab, batch, context))
    options = dict(attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=model.config.pad_token_id)

    def run(new_tokens: int) -> float:
        start = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **options)
        return time.perf_counter() - start

    prefill_s = run(1)
    step = max(run(1 + steps) - prefill_s, 1e-9) / steps
    return {"prefill_s": prefill_s, "step_latency_s": step, "tokens_per_s": batch / step}


def _memory_worker(model_dir: str, cache: CacheConfig, tokens: int, prompt_tokens: int, queue) -> None:
    import psutil

    decoder = DecoderStep(Path(model_dir))
    engine = Engine(decoder, max_batch_size=1)
    prompt = random_prompts(decoder.spec.vocab_size, 1, prompt_tokens)[0]
    engine.add_request(GenerationRequest("m", prompt, SamplingParams(max_tokens=tokens, ignore_eos=True), cache))
    process, samples, generated = psutil.Process(), [], 0
    every = max(1, tokens // 32)
    while engine.has_unfinished():
        generated += len(engine.step())
        if engine.has_unfinished() and (generated % every == 0 or generated == tokens - 1):
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
            samples.append({"generated": generated, "kv_bytes": engine.kv_bytes_in_use, "rss_bytes": process.memory_info().rss, "peak_rss_bytes": peak})
    queue.put(samples)


def measure_memory(model_dir: Path, cache: CacheConfig, tokens: int, prompt_tokens: int = 64) -> list[dict]:
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    worker = context.Process(target=_memory_worker, args=(str(model_dir), cache, tokens, prompt_tokens, queue))
    worker.start()
    samples = queue.get()
    worker.join()
    return samples


def plot(report: dict, out_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (speed, latency) = plt.subplots(1, 2, figsize=(12, 4.5))
    for row_key in dict.fromkeys((row["system"], row["batch"]) for row in report["decode"]):
        rows = [row for row in report["decode"] if (row["system"], row["batch"]) == row_key]
        label = f"{row_key[0]} (batch {row_key[1]})"
        style = "--" if row_key[0] == "hf-generate" else "-"
        speed.plot([r["context"] for r in rows], [r["tokens_per_s"] for r in rows], style, marker="o", label=label)
        latency.plot([r["context"] for r in rows], [1000 * r["step_latency_s"] for r in rows], style, marker="o", label=label)
    for axes, ylabel in ((speed, "decode tokens/s"), (latency, "per-step latency (ms)")):
        axes.set(xscale="log", yscale="log", xlabel="context tokens", ylabel=ylabel)
        axes.grid(True, which="both", alpha=0.3)
    speed.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(out_dir / "decode_speed.png", dpi=120)
    plt.close(figure)

    figure, (rss, kv) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, samples in report["memory"].items():
        generated = [s["generated"] for s in samples]
        rss.plot(generated, [s["peak_rss_bytes"] / 2**20 for s in samples], marker=".", label=name)
        kv.plot(generated, [s["kv_bytes"] / 2**20 for s in samples], marker=".", label=name)
    rss.set(xlabel="generated tokens", ylabel="peak process memory (MiB)")
    kv.set(xlabel="generated tokens", ylabel="KV cache (MiB)")
    rss.legend()
    figure.tight_layout()
    figure.savefig(out_dir / "memory.png", dpi=120)
    plt.close(figure)


def speedups(report: dict, target_context: int = 8192) -> list[str]:
    decode = report["decode"]
    context = min({row["context"] for row in decode}, key=lambda c: abs(c - target_context))
    lines = []
    for batch in sorted({row["batch"] for row in decode}):
        rows = {row["system"]: row for row in decode if row["context"] == context and row["batch"] == batch}
        for name, row in rows.items():
            if name in ("full", "hf-generate"):
                continue
            versus = [f"{row['tokens_per_s'] / rows[other]['tokens_per_s']:.2f}x vs {other}" for other in ("full", "hf-generate") if other in rows]
            lines.append(f"context {context}, batch {batch}: {name} {row['tokens_per_s']:.1f} tok/s, " + ", ".join(versus))
    return lines


def prepare_quick_model(work: Path) -> tuple[Path, Path]:
    from export.pipeline import export_model
    from export.tiny_model import build_tiny_llama

    hf_dir = build_tiny_llama(work / "hf")
    export_model(hf_dir, work / "onnx")
    return work / "onnx", hf_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.speed", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="exported model directory (required unless --quick)")
    parser.add_argument("--hf-model", type=Path, help="the Hugging Face directory it was exported from")
    parser.add_argument("--quick", action="store_true", help="tiny random model, short contexts: checks the plumbing")
    parser.add_argument("--contexts", help="comma-separated context lengths")
    parser.add_argument("--budgets", help="comma-separated slot budgets")
    parser.add_argument("--batches", help="comma-separated batch sizes")
    parser.add_argument("--policies", default="streaming,kvpop", help="bounded policies to time at each budget")
    parser.add_argument("--decode-steps", type=int)
    parser.add_argument("--memory-tokens", type=int, help="generated length of the memory run")
    parser.add_argument("--prefill-chunk", type=int, default=256)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--out-dir", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args(argv)

    plan = dict(QUICK_RUN if args.quick else FULL_RUN)
    for key in ("contexts", "budgets", "batches"):
        if getattr(args, key):
            plan[key] = tuple(int(value) for value in getattr(args, key).split(","))
    plan["decode_steps"] = args.decode_steps or plan["decode_steps"]
    plan["memory_tokens"] = args.memory_tokens or plan["memory_tokens"]
    work = Path(tempfile.mkdtemp(prefix="kvpop-speed-"))
    if args.model is None:
        if not args.quick:
            parser.error("--model is required (or use --quick)")
        args.model, args.hf_model = prepare_quick_model(work)
    args.out_dir.mkdir(parents=True, exist_ok=True)

    decoder = DecoderStep(args.model, device=args.device)
    hf_model = None
    if args.hf_model and not args.skip_hf:
        from transformers import AutoModelForCausalLM

        hf_model = AutoModelForCausalLM.from_pretrained(args.hf_model).eval()
    configs = cache_configs(plan["budgets"], tuple(args.policies.split(",")))
    report = {"model": str(args.model), "plan": plan, "device": args.device, "decode": [], "memory": {}}
    for context in plan["contexts"]:
        for batch in plan["batches"]:
            for name, cache in configs.items():
                row = time_engine_decode(decoder, cache, batch, context, plan["decode_steps"], args.prefill_chunk)
                report["decode"].append({"system": name, "batch": batch, "context": context, **row})
                print(f"ctx {context:6d} batch {batch} {name:15s} {row['tokens_per_s']:9.1f} tok/s  step {1000 * row['step_latency_s']:8.2f} ms", flush=True)
            if hf_model is not None:
                row = time_hf_decode(hf_model, batch, context, plan["decode_steps"], decoder.spec.vocab_size)
                report["decode"].append({"system": "hf-generate", "batch": batch, "context": context, **row})
                print(f"ctx {context:6d} batch {batch} {'hf-generate':15s} {row['tokens_per_s']:9.1f} tok/s  step {1000 * row['step_latency_s']:8.2f} ms", flush=True)
    bounded = CacheConfig(policy="kvpop", budget=plan["memory_budget"], sinks=4, window=min(64, plan["memory_budget"] // 4))
    for name, cache in {"full": CacheConfig(policy="full"), f"kvpop-{plan['memory_budget']}": bounded}.items():
        report["memory"][name] = measure_memory(args.model, cache, plan["memory_tokens"])
        last = report["memory"][name][-1]
        print(f"memory {name}: {last['generated']} tokens, KV {last['kv_bytes'] / 2**20:.3f} MiB, peak RSS {last['peak_rss_bytes'] / 2**20:.0f} MiB", flush=True)
    report["speedups"] = speedups(report)
    (args.out_dir / "speed.json").write_text(json.dumps(report, indent=2) + "\n")
    plot(report, args.out_dir)
    print("\n".join(report["speedups"]))
    print(f"wrote {args.out_dir}/speed.json, decode_speed.png, memory.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
