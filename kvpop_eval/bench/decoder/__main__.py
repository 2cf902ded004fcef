"""Speed harness (a program, not a test): decode speed and memory of the engine vs Hugging Face.

    python -m kvpop_eval.bench.decoder --out-dir build/results/speed  # builds + exports a random Llama of
                                                               # realistic shape (kvpop_eval/bench/bench_model.py)
    python -m kvpop_eval.bench.decoder --model ONNX_DIR --hf-model HF_DIR --out-dir DIR
    python -m kvpop_eval.bench.decoder --quick --out-dir /tmp/speed    # tiny random model, seconds (plumbing)
    python -m kvpop_eval.bench.decoder --model ONNX_DIR --hf-model HF_DIR --extra-policies kvpop:mlstm,kvpop:mlp \
        --untrained-scorers-dir build/speed-x                  # learned scorers (see 3. below)

1. Decode latency per step and tokens/s vs context length for `full` vs fixed budgets (each bounded
   policy at each budget), at each batch size, and HF `generate` with its default dynamic cache on the
   same model, contexts and batch sizes, in one run. Medians over `--decode-steps` timed steps after
   `--warmup-steps` untimed ones (the first decode step repacks the batch pool and, for `full`, grows
   the cache by a block).
2. Peak process memory and KV bytes vs generated length for `full` vs bounded policies, each in its
   own process (so peaks do not mix), sampled during one long generation.
3. The learned KVpop scorers (`kvpop:mlstm`, `kvpop:mlp` in --policies / --extra-policies; their
   window is the one they were trained for): kvpop's own per-step overhead (kvpop:<kind> minus
   `streaming` at the same budget, which scores nothing), and the scorer call alone
   (`LearnedScorer.score_decode_batch`, what a vectorised decode step runs once per step) per batch
   size. The scorers are the model directory's; with --untrained-scorers-dir the run times a copy of
   the directory made there, with an initialised, untrained scorer of the model's shape for each kind
   the model lacks: a scorer's cost does not depend on its weight values.
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
import gc
import json
import multiprocessing
import os
import platform
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from kvpop.cache import SlotCache

from kvpop.cache.manager import Allocation, append_output
from kvpop.decoder import DecoderStep
from kvpop.engine import Engine, EngineConfig, load_learned_scorers
from kvpop.engine.sequence import Sequence
from kvpop.request import CacheConfig, GenerationRequest, SamplingParams
from kvpop.policies.kvpop.scorers import TokenScorer
from kvpop.sampling import Sampler
from kvpop.policies.kvpop.kinds import LEARNED_SCORER_KINDS

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


def random_prompt(vocab: int, tokens: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(3, vocab, size=tokens).tolist()


def bounded_config(policy: str, budget: int) -> CacheConfig:
    """`policy` is a policy name, or `kvpop:<learned kind>` (the window is then the scorer's own)."""
    policy, _, scorer = policy.partition(":")
    if scorer and (policy != "kvpop" or scorer not in LEARNED_SCORER_KINDS):
        raise ValueError(f"a scorer is named as kvpop:<kind> with kind in {LEARNED_SCORER_KINDS}, got {policy}:{scorer}")
    extra = {"scorer": scorer} if scorer else {}
    return CacheConfig(policy=policy, budget=budget, sinks=4, window=min(64, budget // 4), **extra)


def copy_cache(cache: SlotCache) -> SlotCache:
    """A deep copy of `cache` that shares its policy's scorer: a learned scorer holds an onnxruntime
    session (not copyable), and the engine batches only caches whose scorer is the same object."""
    scorer = getattr(cache.policy, "token_scorer", None)
    return copy.deepcopy(cache, {} if scorer is None else {id(scorer): scorer})


def cache_configs(budgets: tuple[int, ...], policies: tuple[str, ...], extra_policies: tuple[str, ...] = ()) -> dict[str, CacheConfig]:
    configs = {"full": CacheConfig(policy="full")}
    for policy in policies:
        for budget in budgets:
            configs[f"{policy}-{budget}"] = bounded_config(policy, budget)
    for policy in extra_policies:
        configs[f"{policy}-{budgets[0]}"] = bounded_config(policy, budgets[0])
    return configs


# -- engine ----------------------------------------------------------------------------------------


def prefill_snapshots(decoder: DecoderStep, cache: CacheConfig, prompt: list[int], contexts, prefill_chunk: int, learned_scorers: dict):
    """Prefill `prompt` as Engine._prefill does; snapshot (cache, last logits) at each context."""
    tokens = np.asarray(prompt, dtype=np.int64)
    slot_cache = SlotCache(decoder.spec, cache.build_policy(learned_scorers), cache.resolve_budget(len(tokens), 1))
    chunk_size = prefill_chunk if slot_cache.budget is None else min(prefill_chunk, slot_cache.budget)
    wanted, snapshots = set(contexts), {}
    for start in range(0, len(tokens), chunk_size):
        chunk = tokens[start : start + chunk_size]
        positions = np.arange(start, start + len(chunk), dtype=np.int64)
        out = decoder.run(  # the graph Engine._run_piece runs: last position's logits, attention only if read
            chunk[None], positions[None], slot_cache.key[:, None], slot_cache.value[:, None], slot_cache.slot_mask()[None],
            last_only=True, attention=slot_cache.policy.needs_attention,
        )
        append_output(slot_cache, out, row=0)
        if start + len(chunk) in wanted:
            snapshots[start + len(chunk)] = (copy_cache(slot_cache), out.logits[0, -1].copy())
    missing = wanted - snapshots.keys()
    if missing:
        raise ValueError(f"contexts {sorted(missing)} are not multiples of the prefill chunk {chunk_size}")
    return snapshots


def check_snapshot(decoder: DecoderStep, cache: CacheConfig, prompt: list[int], snapshot, prefill_chunk: int, learned_scorers: dict) -> float:
    """The snapshot equals what Engine.prefill leaves for the same prompt (max |key diff|)."""
    engine = Engine(decoder, EngineConfig(max_batch_size=1, prefill_chunk=prefill_chunk), learned_scorers=learned_scorers)
    sequence = engine.prefill(GenerationRequest("check", prompt, SamplingParams(max_tokens=1), cache))
    mine, theirs = snapshot[0], sequence.cache
    assert mine.length == theirs.length and mine.tokens_seen == theirs.tokens_seen
    assert np.array_equal(mine.position[..., : mine.length], theirs.position[..., : theirs.length])
    return float(np.abs(mine.key[:, :, : mine.length] - theirs.key[:, :, : theirs.length]).max())


class SnapshotEngine(Engine):
    """The engine, except that admission restores a prefilled snapshot instead of prefilling."""

    def __init__(self, *args, snapshot, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.snapshot = snapshot

    def _new_sequence(self, request: GenerationRequest) -> Sequence:
        cache, logits = self.snapshot
        sequence = Sequence(request=request, allocation=Allocation(copy_cache(cache)), sampler=Sampler(request.sampling))
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


def time_point(decoder, snapshots: dict, configs: dict, hf_model, prompt, batch: int, steps: int, warmup: int, block: int, learned_scorers: dict) -> dict:
    """Median decode step time of every system at one (context, batch), measured INTERLEAVED: in
    each round every engine configuration runs `block` steps and HF generate runs `block` steps, so
    load from other processes on a shared machine hits all systems alike."""
    engines = {}
    for name, cache in configs.items():
        engine = SnapshotEngine(decoder, config=EngineConfig(max_batch_size=batch), snapshot=snapshots[name], learned_scorers=learned_scorers)
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
            # Whether the decode steps took the vectorised kvpop path (kvpop.policies.kvpop.decode_batch).
            engine = engines[name]
            vectorised = all(engine.sequence(request_id).cache.policy.decode_group(engine.sequence(request_id).cache) is not None
                             for request_id in engine.state().decoding)
            rows[name] = {**summarize(values, batch), "kv_bytes": engines[name].kv_bytes_in_use, "cache_slots": engines[name].cache_manager.pool.slots, "vectorised_decode": vectorised}
    del engines, hf_base
    gc.collect()  # a pool and its bound caches refer to each other: free them now, not at some later gc
    return rows


def memory_needed(spec, context: int, batch: int) -> int:
    """Bytes a point needs at its peak beyond what the process holds, in units of the B sequences'
    full cache (KV): the full engine's pool while a growth by one block packs a new pool from new
    caches (3 KV, in warm-up), or its pool beside HF's cache and the grown copy its DynamicCache
    concatenates each step (3 KV), plus the runtimes' working memory (SmolLM2 at 8k x 8: 2.8 GB of
    KV, the process grew by 10.7 GB)."""
    kv = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * np.dtype(spec.dtype).itemsize * (context + 64) * batch
    return 4 * kv


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
    engine = Engine(decoder, EngineConfig(max_batch_size=1), learned_scorers=load_learned_scorers(Path(model_dir)) if cache.learned_scorer else None)
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


# -- learned scorers -------------------------------------------------------------------------------

UNTRAINED = "untrained: initialised (seed 0) by kvpop_eval.bench.decoder for timing only"


def scratch_model_dir(model_dir: Path, scratch: Path, kinds: set[str], window: int) -> Path:
    """A copy of the export `model_dir` in `scratch` (a re-export of `model_dir` mid-run cannot change
    the graphs being timed; the weights are copied, not linked: onnxruntime refuses external data
    outside the model's directory) with a learned scorer of every kind in `kinds`: the model's own
    where it has one, else an initialised, UNTRAINED scorer of the model's shape with protected
    window `window` (speed only). Files already copied (same size and time) are kept."""
    model_dir, scratch = Path(model_dir).resolve(), Path(scratch)
    scratch.mkdir(parents=True, exist_ok=True)
    for source in model_dir.iterdir():
        if source.name == "__pycache__":
            continue
        target = scratch / source.name
        if source.is_file() and target.is_file() and not target.is_symlink():
            mine, theirs = target.stat(), source.stat()
            if (mine.st_size, mine.st_mtime_ns) == (theirs.st_size, theirs.st_mtime_ns):
                continue
        if target.is_symlink() or target.is_file():
            target.unlink()
        elif target.is_dir():
            shutil.rmtree(target)
        if source.is_dir():
            shutil.copytree(source, target)
        else:
            shutil.copy2(source, target)
    missing = sorted(kind for kind in kinds if not (model_dir / f"scorer_{kind}.json").exists())
    if missing:
        import torch

        from kvpop_train.scorer.network import Scorer, ScorerConfig
        from kvpop_train.scorer.onnx_export import export_scorer

        spec = json.loads((model_dir / "model_spec.json").read_text())
        for kind in missing:
            config = ScorerConfig(kind=kind, num_layers=spec["num_layers"], num_kv_heads=spec["num_kv_heads"], head_dim=spec["head_dim"], window=window)
            previous = scratch / f"scorer_{kind}.json"
            earlier = json.loads(previous.read_text()) if previous.exists() else {}
            if earlier.get("source") == UNTRAINED and earlier.get("config") == config.to_dict():
                continue  # exported by an earlier run
            torch.manual_seed(0)
            exported = export_scorer(Scorer(config), scratch, source=UNTRAINED)
            print(f"exported an untrained {kind} scorer of the model's shape (window {window}) to {exported.onnx_path} (parity {exported.max_abs_diff:.1e})", flush=True)
    return scratch


def scorer_notes(model_dir: Path, kinds: set[str]) -> dict[str, dict]:
    """What each learned scorer in use is: its window, shape and where its weights came from."""
    notes = {}
    for kind in sorted(kinds):
        data = json.loads((Path(model_dir) / f"scorer_{kind}.json").read_text())
        notes[kind] = {
            "window": data["config"]["window"], "memory_dim": data["config"].get("memory_dim"), "hidden_dim": data["config"].get("hidden_dim"),
            "source": data.get("source", ""), "trained": data.get("source", "") != UNTRAINED,
            "batch_graph": data.get("decode_onnx_file"),
        }
    return notes


def time_scorer_calls(learned_scorers: dict[str, TokenScorer], kinds: set[str], spec, batches, repeats: int = 40, warmup: int = 3) -> list[dict]:
    """The learned scorer alone, as one vectorised decode step calls it: `score_decode_batch` on B
    sequences' new and leaving tokens, (B, L, Hkv, D) each (medians of `repeats` calls). For a
    stateful kind at B > 1 (the engine runs its tiled batch graph) it also times the alternative,
    B calls of the one-sequence step, interleaved with it call by call."""
    rng = np.random.default_rng(0)
    rows = []
    for kind in sorted(kinds):
        scorer = learned_scorers[kind]
        runtime = scorer.runtime
        for batch in batches:
            tokens = [rng.standard_normal((batch, spec.num_layers, spec.num_kv_heads, spec.head_dim)).astype(np.float32) for _ in range(4)]
            states = [scorer.init_state() for _ in range(batch)]

            def one_by_one() -> None:
                for row, state in enumerate(states):
                    runtime.step(state.recurrent, *(array[row, :, :, None] for array in tokens))

            variants = {"engine": lambda: scorer.score_decode_batch(states, *tokens)}
            if runtime.spec.state_shapes and runtime.decode_session is not None and batch > 1:
                variants["one_sequence_calls"] = one_by_one
            times: dict[str, list[float]] = {name: [] for name in variants}
            for _ in range(warmup + repeats):
                for name, call in variants.items():
                    start = time.perf_counter()
                    call()
                    times[name].append(time.perf_counter() - start)
            row = {"kind": kind, "batch": batch, "calls_timed": repeats}
            for name, values in times.items():
                median = statistics.median(values[warmup:])
                prefix = "call" if name == "engine" else name
                row[f"{prefix}_ms"] = 1000 * median
                row[f"{prefix}_p90_ms"] = 1000 * float(np.percentile(values[warmup:], 90))
            row["ms_per_sequence"] = row["call_ms"] / batch
            rows.append(row)
    return rows


def policy_overheads(report: dict) -> list[dict]:
    """Each kvpop system's step time minus `streaming`'s at the same budget, context and batch:
    what kvpop's scoring and bookkeeping add (streaming evicts by position and scores nothing)."""
    table = []
    for row in report["decode"]:
        policy, _, budget = row["system"].rpartition("-")
        if not policy.startswith("kvpop"):
            continue
        baseline = [r for r in report["decode"] if r["system"] == f"streaming-{budget}" and r["context"] == row["context"] and r["batch"] == row["batch"]]
        if baseline:
            base = baseline[0]["step_latency_s"]
            table.append({
                "system": row["system"], "versus": f"streaming-{budget}", "context": row["context"], "batch": row["batch"],
                "overhead_ms_per_step": 1000 * (row["step_latency_s"] - base), "overhead_ms_per_token": 1000 * (row["step_latency_s"] - base) / row["batch"],
                "overhead_fraction": row["step_latency_s"] / base - 1,
            })
    return table


def overhead_lines(report: dict, target_context: int = 8192) -> list[str]:
    contexts = {row["context"] for row in report["policy_overhead"]}
    if not contexts:
        return []
    context = min(contexts, key=lambda c: abs(c - target_context))
    lines = [
        f"context {context}, batch {e['batch']}: {e['system']} - {e['versus']}: {e['overhead_ms_per_step']:+.2f} ms/step ({100 * e['overhead_fraction']:+.1f}%)"
        for e in report["policy_overhead"] if e["context"] == context
    ]
    for r in report["scorer_calls"]:
        alternative = f"; {r['batch']} one-sequence calls: {r['one_sequence_calls_ms']:.2f} ms" if "one_sequence_calls_ms" in r else ""
        lines.append(f"scorer call alone: {r['kind']} batch {r['batch']}: {r['call_ms']:.2f} ms/step ({r['ms_per_sequence']:.3f} ms per sequence){alternative}")
    return lines


# -- report ----------------------------------------------------------------------------------------


def plot(report: dict, out_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted({row["batch"] for row in report["decode"]})
    figure, axes = plt.subplots(1, len(batches), figsize=(6.5 * len(batches), 4.8), squeeze=False)
    for axis, batch in zip(axes[0], batches):
        for system in dict.fromkeys(row["system"] for row in report["decode"]):
            rows = sorted((row for row in report["decode"] if row["system"] == system and row["batch"] == batch), key=lambda row: row["context"])
            style = "--" if system == "hf-generate" else (":" if system == "full" else "-")
            axis.plot([r["context"] for r in rows], [r["ms_per_token"] for r in rows], style, marker="o", label=system)
        axis.set(xscale="log", yscale="log", xlabel="context tokens", ylabel="decode ms per token (median)", title=f"batch {batch}")
        axis.set_xticks([r for r in report["plan"]["contexts"]], [str(r) for r in report["plan"]["contexts"]])
        axis.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())  # only the measured contexts are labelled
        axis.grid(True, which="both", alpha=0.3)
        axis.legend(fontsize=7)
    figure.suptitle(report["model_note"], fontsize=8)
    figure.tight_layout()
    figure.savefig(out_dir / "decode_speed.png", dpi=120)
    plt.close(figure)

    if not report["memory"]:
        return
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
        from kvpop_eval.bench.bench_model import build_bench_llama

        hf_dir = build_bench_llama(work / "hf")
    export_model(hf_dir, work / "onnx")
    return work / "onnx", hf_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvpop_eval.bench.decoder", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    work = Path(tempfile.mkdtemp(prefix="kvpop-speed-"))
    random_weights = args.model is None
    if args.model is None:
        args.model, args.hf_model = prepare_model(work, args.quick)
    configs = cache_configs(plan["budgets"], plan["policies"], plan["extra_policies"])
    memory_configs = {"full": CacheConfig(policy="full")}
    for policy in plan["memory_policies"]:
        memory_configs[f"{policy}-{plan['memory_budget']}"] = bounded_config(policy, plan["memory_budget"])
    kinds = {cache.learned_scorer for cache in (*configs.values(), *(memory_configs.values() if plan["memory_tokens"] else ())) if cache.learned_scorer}
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
        "method": "snapshots of one real prefill (to max context) per cache config; batch rows are copies; HF generate continues from a DynamicCache with the same tokens; systems interleaved in blocks of `block` steps; medians of timed steps after warmup",
        "decode": [],
        "memory": {},
        "checks": {},
        "learned_scorers": scorer_notes(args.model, kinds),
    }
    prompt = random_prompt(spec.vocab_size, max(plan["contexts"]))
    snapshots = {}
    for name, cache in configs.items():
        start = time.perf_counter()
        snapshots[name] = prefill_snapshots(decoder, cache, prompt, plan["contexts"], plan["prefill_chunk"], learned_scorers)
        smallest = min(plan["contexts"])
        diff = check_snapshot(decoder, cache, prompt[:smallest], snapshots[name][smallest], plan["prefill_chunk"], learned_scorers)
        report["checks"][f"{name}: snapshot vs Engine._prefill max |key diff| at {smallest}"] = diff
        report["prefill_s"] = {**report.get("prefill_s", {}), name: time.perf_counter() - start}
        print(f"prefill {name:14s} {max(plan['contexts'])} tokens in {time.perf_counter() - start:6.1f} s (snapshot check {diff:.1e})", flush=True)

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
            point = {name: snapshots[name][context] for name in configs}
            rows = time_point(decoder, point, configs, hf_model, prompt, batch, plan["decode_steps"], plan["warmup_steps"], plan["block"], learned_scorers)
            for name, row in rows.items():
                report["decode"].append({"system": name, "batch": batch, "context": context, **row})
                print(f"ctx {context:6d} batch {batch} {name:14s} {row['ms_per_token']:8.2f} ms/token {row['tokens_per_s']:8.1f} tok/s  step {1000 * row['step_latency_s']:8.2f} ms (p90 {1000 * row['step_latency_p90_s']:.1f})", flush=True)
        for name in configs:  # this context's snapshots are no longer needed
            snapshots[name].pop(context)
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
