"""Peak process memory and KV bytes vs generated length, one cache configuration per spawned process
(so peaks do not mix), sampled during one long generation."""

from __future__ import annotations

import multiprocessing
import resource
import time
from pathlib import Path

from kvpop.decoder import DecoderStep
from kvpop.engine import Engine, EngineConfig, load_policy_assets
from kvpop.policies.kvpop.kinds import requested_learned_scorer
from kvpop.request import CacheConfig, GenerationRequest, SamplingParams

from kvpop_eval.bench.decoder.contexts import random_prompt


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
    engine = Engine(decoder, EngineConfig(max_batch_size=1), policy_assets=load_policy_assets(Path(model_dir)) if requested_learned_scorer(cache) else None)
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
