"""Speed harness (a program, not a test): decode speed and memory of the engine vs Hugging Face.

    python -m benchmarks.speed --out-dir docs/benchmarks      # builds + exports a random Llama of
                                                               # realistic shape (benchmarks/bench_model.py)
    python -m benchmarks.speed --model ONNX_DIR --hf-model HF_DIR --out-dir DIR
    python -m benchmarks.speed --quick --out-dir /tmp/speed    # tiny random model, seconds (plumbing)

1. Decode latency per step and tokens/s vs context length for `full` vs fixed budgets (each bounded
   policy at each budget), at each batch size, and HF `generate` with its default dynamic cache on the
   same model, contexts and batch sizes, in one run. Medians over `--decode-steps` timed steps after
   `--warmup-steps` untimed ones (the first decode step repacks the batch pool and, for `full`, grows
   the cache by a block).
2. Peak process memory and KV bytes vs generated length for `full` vs bounded policies, each in its
   own process (so peaks do not mix), sampled during one long generation.
Writes speed.json, decode_speed.png, memory.png, and prints the speedups at the context nearest 8k.

How the contexts are reached, and why it is the same state a real prefill leaves: for every cache
configuration ONE prompt of max(contexts) tokens is prefilled once, exactly as `Engine._prefill`
does (same chunking; checked against the engine's own prefill at the smallest context), and the
cache is snapshotted when the prefix reaches each context. A decode point at context C and batch B
then runs the real engine (`Engine.step`, batch pool, policy bookkeeping, sampling) over B copies of
the snapshot. HF `generate` is given a DynamicCache holding the same C keys/values (the exported
step's keys are HF's post-RoPE keys; parity is checked at export) and the prompt, so it processes
only the new tokens; its per-step time is taken between successive logits-processor calls. Decode
cost does not depend on the cached values, so the clones and the shared cache time the same work as
B independent prompts would, without paying B x (contexts x configs) prefills on a 2-core machine.
"""

from __future__ import annotations

import argparse
import copy
import json
import multiprocessing
import os
import platform
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from kvpop.cache import SlotCache
from kvpop.cache.manager import Allocation, append_output
from kvpop.decoder import DecoderStep
from kvpop.engine import CacheConfig, Engine, GenerationRequest, SamplingParams, _Sequence
from kvpop.sampling import Sampler

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


def random_prompt(vocab: int, tokens: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(3, vocab, size=tokens).tolist()


def bounded_config(policy: str, budget: int) -> CacheConfig:
    return CacheConfig(policy=policy, budget=budget, sinks=4, window=min(64, budget // 4))


def cache_configs(budgets: tuple[int, ...], policies: tuple[str, ...], extra_policies: tuple[str, ...] = ()) -> dict[str, CacheConfig]:
    configs = {"full": CacheConfig(policy="full")}
    for policy in policies:
        for budget in budgets:
            configs[f"{policy}-{budget}"] = bounded_config(policy, budget)
    for policy in extra_policies:
        configs[f"{policy}-{budgets[0]}"] = bounded_config(policy, budgets[0])
    return configs


# -- engine ----------------------------------------------------------------------------------------


def prefill_snapshots(decoder: DecoderStep, cache: CacheConfig, prompt: list[int], contexts, prefill_chunk: int):
    """Prefill `prompt` as Engine._prefill does; snapshot (cache, last logits) at each context."""
    tokens = np.asarray(prompt, dtype=np.int64)
    slot_cache = SlotCache(decoder.spec, cache.build_policy(), cache.resolve_budget(len(tokens), 1))
    chunk_size = prefill_chunk if slot_cache.budget is None else min(prefill_chunk, slot_cache.budget)
    wanted, snapshots = set(contexts), {}
    for start in range(0, len(tokens), chunk_size):
        chunk = tokens[start : start + chunk_size]
        positions = np.arange(start, start + len(chunk), dtype=np.int64)
        out = decoder.run(chunk[None], positions[None], slot_cache.key[:, None], slot_cache.value[:, None], slot_cache.slot_mask()[None])
        append_output(slot_cache, out, row=0)
        if start + len(chunk) in wanted:
            snapshots[start + len(chunk)] = (copy.deepcopy(slot_cache), out.logits[0, -1].copy())
    missing = wanted - snapshots.keys()
    if missing:
        raise ValueError(f"contexts {sorted(missing)} are not multiples of the prefill chunk {chunk_size}")
    return snapshots


def check_snapshot(decoder: DecoderStep, cache: CacheConfig, prompt: list[int], snapshot, prefill_chunk: int) -> float:
    """The snapshot equals what Engine._prefill leaves for the same prompt (max |key diff|)."""
    engine = Engine(decoder, max_batch_size=1, prefill_chunk=prefill_chunk)
    sequence = engine._prefill(GenerationRequest("check", prompt, SamplingParams(max_tokens=1), cache))
    mine, theirs = snapshot[0], sequence.cache
    assert mine.length == theirs.length and mine.tokens_seen == theirs.tokens_seen
    assert np.array_equal(mine.position[..., : mine.length], theirs.position[..., : theirs.length])
    return float(np.abs(mine.key[:, :, : mine.length] - theirs.key[:, :, : theirs.length]).max())


class SnapshotEngine(Engine):
    """The engine, except that admission restores a prefilled snapshot instead of prefilling."""

    def __init__(self, *args, snapshot, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.snapshot = snapshot

    def _new_sequence(self, request: GenerationRequest) -> _Sequence:
        cache, logits = self.snapshot
        sequence = _Sequence(request=request, allocation=Allocation(copy.deepcopy(cache)), sampler=Sampler(request.sampling))
        sequence.prefilled = len(request.prompt_ids)
        sequence.pending_token = sequence.sampler(logits)
        return sequence


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


def hf_cache_from_snapshot(full_snapshot, batch: int):
    """A DynamicCache (HF's default) holding the full snapshot's C tokens for `batch` rows."""
    import torch
    from transformers import DynamicCache

    cache = full_snapshot[0]
    length = cache.length
    assert np.array_equal(cache.position[0, 0, :length], np.arange(length)), "full cache slots are in order"
    past = DynamicCache()
    for layer in range(cache.key.shape[0]):
        key = torch.from_numpy(np.ascontiguousarray(cache.key[layer, :, :length]))[None].repeat(batch, 1, 1, 1)
        value = torch.from_numpy(np.ascontiguousarray(cache.value[layer, :, :length]))[None].repeat(batch, 1, 1, 1)
        past.update(key, value, layer)
    return past


def hf_generate_block(model, base_cache, ids, tokens: int) -> list[float]:
    """Continue HF generate (greedy, DynamicCache) from a copy of `base_cache` for `tokens` decode
    steps; returns each step's time (between successive logits-processor calls)."""
    import torch
    from transformers import LogitsProcessorList

    past = copy.deepcopy(base_cache)
    clock = Clock()
    new_tokens = tokens + 1
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            past_key_values=past,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=model.config.pad_token_id,
            logits_processor=LogitsProcessorList([clock]),
        )
    assert out.shape[1] == ids.shape[1] + new_tokens
    return np.diff(clock.stamps).tolist()


def time_point(decoder, snapshots: dict, configs: dict, hf_model, prompt, batch: int, steps: int, warmup: int, block: int) -> dict:
    """Median decode step time of every system at one (context, batch), measured INTERLEAVED: in
    each round every engine configuration runs `block` steps and HF generate runs `block` steps, so
    load from other processes on a shared machine hits all systems alike."""
    engines = {}
    for name, cache in configs.items():
        engine = SnapshotEngine(decoder, max_batch_size=batch, snapshot=snapshots[name])
        sampling = SamplingParams(max_tokens=warmup + steps + block + 2, ignore_eos=True)
        for index in range(batch):
            engine.add_request(GenerationRequest(f"b{index}", [3], sampling, cache))
        engine.step()  # admits everyone (restores the snapshots)
        for _ in range(warmup):  # first steps: pool repack, full-cache block growth
            engine.step()
        engines[name] = engine
    latencies: dict[str, list[float]] = {name: [] for name in engines}
    hf_base = hf_ids = None
    if hf_model is not None:
        import torch

        hf_base = hf_cache_from_snapshot(snapshots["full"], batch)
        length = snapshots["full"][0].length
        hf_ids = torch.tensor([prompt[:length] + [int(np.argmax(snapshots["full"][1]))]] * batch)
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
    for name, values in latencies.items():
        if name == "hf-generate":
            kv_bytes = 2 * decoder.spec.num_layers * batch * decoder.spec.num_kv_heads * snapshots["full"][0].length * decoder.spec.head_dim * decoder.dtype.itemsize
            rows[name] = {**summarize(values, batch), "kv_bytes": kv_bytes}
        else:
            rows[name] = {**summarize(values, batch), "kv_bytes": engines[name].kv_bytes_in_use, "cache_slots": engines[name].cache_manager.pool.slots}
    del engines, hf_base
    return rows


# -- memory ----------------------------------------------------------------------------------------


def peak_rss_bytes() -> int:
    """This process's peak resident set (VmHWM). Not ru_maxrss: on Linux that survives fork + exec,
    so a spawned worker would report its (large) parent's peak."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB (see above)


def _memory_worker(model_dir: str, cache: CacheConfig, tokens: int, prompt_tokens: int, threads: int, queue) -> None:
    import psutil

    decoder = DecoderStep(Path(model_dir), threads=threads)
    engine = Engine(decoder, max_batch_size=1)
    prompt = random_prompt(decoder.spec.vocab_size, prompt_tokens)
    engine.add_request(GenerationRequest("m", prompt, SamplingParams(max_tokens=tokens, ignore_eos=True), cache))
    process, samples, generated = psutil.Process(), [], 0
    every = max(1, tokens // 64)
    start = time.perf_counter()
    while engine.has_unfinished():
        generated += len(engine.step())
        if engine.has_unfinished() and (generated % every == 0 or generated == tokens - 1):
            peak = peak_rss_bytes()
            samples.append({"generated": generated, "kv_bytes": engine.kv_bytes_in_use, "rss_bytes": process.memory_info().rss, "peak_rss_bytes": peak, "elapsed_s": time.perf_counter() - start})
    queue.put(samples)


def measure_memory(model_dir: Path, cache: CacheConfig, tokens: int, threads: int, prompt_tokens: int = 64) -> list[dict]:
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    worker = context.Process(target=_memory_worker, args=(str(model_dir), cache, tokens, prompt_tokens, threads, queue))
    worker.start()
    samples = queue.get()
    worker.join()
    return samples


# -- report ----------------------------------------------------------------------------------------


def plot(report: dict, out_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted({row["batch"] for row in report["decode"]})
    figure, axes = plt.subplots(1, len(batches), figsize=(6.5 * len(batches), 4.8), squeeze=False)
    for axis, batch in zip(axes[0], batches):
        for system in dict.fromkeys(row["system"] for row in report["decode"]):
            rows = [row for row in report["decode"] if row["system"] == system and row["batch"] == batch]
            style = "--" if system == "hf-generate" else (":" if system == "full" else "-")
            axis.plot([r["context"] for r in rows], [r["ms_per_token"] for r in rows], style, marker="o", label=system)
        axis.set(xscale="log", yscale="log", xlabel="context tokens", ylabel="decode ms per token (median)", title=f"batch {batch}")
        axis.set_xticks([r for r in report["plan"]["contexts"]], [str(r) for r in report["plan"]["contexts"]])
        axis.grid(True, which="both", alpha=0.3)
        axis.legend(fontsize=7)
    figure.suptitle(report["model_note"], fontsize=8)
    figure.tight_layout()
    figure.savefig(out_dir / "decode_speed.png", dpi=120)
    plt.close(figure)

    figure, (rss, kv) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, samples in report["memory"].items():
        generated = [s["generated"] for s in samples]
        rss.plot(generated, [s["peak_rss_bytes"] / 2**20 for s in samples], marker=".", label=name)
        kv.plot(generated, [s["kv_bytes"] / 2**20 for s in samples], marker=".", label=name)
    rss.set(xlabel="generated tokens (64-token prompt, batch 1)", ylabel="peak process RSS (MiB)")
    kv.set(xlabel="generated tokens (64-token prompt, batch 1)", ylabel="KV cache (MiB)")
    rss.legend()
    kv.legend()
    figure.tight_layout()
    figure.savefig(out_dir / "memory.png", dpi=120)
    plt.close(figure)


def ratios(report: dict) -> list[dict]:
    table = []
    for row in report["decode"]:
        if row["system"] in ("full", "hf-generate"):
            continue
        same = {r["system"]: r for r in report["decode"] if r["context"] == row["context"] and r["batch"] == row["batch"]}
        entry = {"system": row["system"], "context": row["context"], "batch": row["batch"]}
        for other in ("full", "hf-generate"):
            if other in same:
                entry[f"speedup_vs_{other}"] = same[other]["step_latency_s"] / row["step_latency_s"]
        table.append(entry)
    return table


def speedup_lines(report: dict, target_context: int = 8192) -> list[str]:
    contexts = {row["context"] for row in report["decode"]}
    context = min(contexts, key=lambda c: abs(c - target_context))
    lines = []
    for entry in report["ratios"]:
        if entry["context"] == context:
            versus = ", ".join(f"{entry[key]:.2f}x vs {key[len('speedup_vs_'):]}" for key in entry if key.startswith("speedup_vs_"))
            lines.append(f"context {context}, batch {entry['batch']}: {entry['system']}: {versus}")
    return lines


def prepare_model(work: Path, quick: bool) -> tuple[Path, Path]:
    from export.pipeline import export_model

    if quick:
        from export.tiny_model import build_tiny_llama

        hf_dir = build_tiny_llama(work / "hf")
    else:
        from benchmarks.bench_model import build_bench_llama

        hf_dir = build_bench_llama(work / "hf")
    export_model(hf_dir, work / "onnx")
    return work / "onnx", hf_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.speed", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="exported model directory (default: build benchmarks/bench_model.py's random Llama)")
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
    parser.add_argument("--out-dir", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args(argv)

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
    work = Path(tempfile.mkdtemp(prefix="kvpop-speed-"))
    if args.model is None:
        args.model, args.hf_model = prepare_model(work, args.quick)
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
        + ("; RANDOM weights (speed only)" if not args.quick else "; tiny random model")
        + f"; CPU, {args.threads} thread(s)"
    )
    print(model_note, flush=True)
    report = {
        "model": str(args.model),
        "model_note": model_note,
        "model_spec": {k: getattr(spec, k) for k in ("num_layers", "num_attention_heads", "num_kv_heads", "head_dim", "vocab_size", "max_position_embeddings", "dtype")},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "processor": platform.processor(), "load_average_at_start": os.getloadavg()},
        "plan": plan,
        "method": "snapshots of one real prefill (to max context) per cache config; batch rows are copies; HF generate continues from a DynamicCache with the same tokens; systems interleaved in blocks of `block` steps; medians of timed steps after warmup",
        "decode": [],
        "memory": {},
        "checks": {},
    }
    configs = cache_configs(plan["budgets"], plan["policies"], plan["extra_policies"])
    prompt = random_prompt(spec.vocab_size, max(plan["contexts"]))
    snapshots = {}
    for name, cache in configs.items():
        start = time.perf_counter()
        snapshots[name] = prefill_snapshots(decoder, cache, prompt, plan["contexts"], plan["prefill_chunk"])
        smallest = min(plan["contexts"])
        diff = check_snapshot(decoder, cache, prompt[:smallest], snapshots[name][smallest], plan["prefill_chunk"])
        report["checks"][f"{name}: snapshot vs Engine._prefill max |key diff| at {smallest}"] = diff
        report["prefill_s"] = {**report.get("prefill_s", {}), name: time.perf_counter() - start}
        print(f"prefill {name:14s} {max(plan['contexts'])} tokens in {time.perf_counter() - start:6.1f} s (snapshot check {diff:.1e})", flush=True)

    for context in plan["contexts"]:
        for batch in plan["batches"]:
            point = {name: snapshots[name][context] for name in configs}
            rows = time_point(decoder, point, configs, hf_model, prompt, batch, plan["decode_steps"], plan["warmup_steps"], plan["block"])
            for name, row in rows.items():
                report["decode"].append({"system": name, "batch": batch, "context": context, **row})
                print(f"ctx {context:6d} batch {batch} {name:14s} {row['ms_per_token']:8.2f} ms/token {row['tokens_per_s']:8.1f} tok/s  step {1000 * row['step_latency_s']:8.2f} ms (p90 {1000 * row['step_latency_p90_s']:.1f})", flush=True)
        for name in configs:  # this context's snapshots are no longer needed
            snapshots[name].pop(context)
    report["ratios"] = ratios(report)

    if plan["memory_tokens"]:
        memory_configs = {"full": CacheConfig(policy="full")}
        for policy in plan["memory_policies"]:
            memory_configs[f"{policy}-{plan['memory_budget']}"] = bounded_config(policy, plan["memory_budget"])
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
    report["wall_s"] = time.perf_counter() - began
    (args.out_dir / "speed.json").write_text(json.dumps(report, indent=2) + "\n")
    plot(report, args.out_dir)
    print("\n".join(report["speedups_at_8k"]))
    print(f"wrote {args.out_dir}/speed.json, decode_speed.png, memory.png in {report['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
