"""Service benchmark (a program, not a test): the real tritonserver vs the classic design, end to end.

    python -m kvpop_eval.bench.service --model build/bench/reference --hf-model models/reference \
        --out-dir build/results/service-reference              # make bench-service

Starts the real server (kvpop.serving.process.launcher.TritonServer, CPU config) on the exported model, and
the classic design (kvpop_eval/bench/classic_server.py: FastAPI + Hugging Face `generate`, full cache,
dynamic batcher) on the same weights, then measures with closed-loop clients, every cell once per
repetition and repetitions interleaved (rep 1 of every cell, then rep 2, ...), so a slow minute of a
shared machine hits every system alike:

  (a) long:   2048-token prompts, 32 output tokens, concurrency 1/4/8
  (b) reason: 512-token prompts, --reason-tokens output tokens (1024 by default), concurrency 4/8
  (c) pool:   --pool-users users (16 by default), 512-token prompts, --pool-tokens output tokens, KV
              pool sized to hold only 4 full-cache sequences (the classic design: batches of 4);
              max_running_sequences is raised to the user count there, so memory alone decides
              how many run at once
  (d) chat:   ~100-token prompts, 32 output tokens, concurrency 1/4/8
  stall:      4 running streams; a 2048-token prompt arrives; the running streams' longest gap while
              it is prefilled vs their median gap

Systems: `full`, `kvpop` at 88% compression (the engine's kvpop scorer), `classic`. The service is
measured over gRPC streaming on kvpop_engine (token timestamps: TTFT, inter-token latency); the
classic design does not stream, so its TTFT is its latency; `--service-responses complete` asks the
service the same way (one answer per request from kvpop_service, the product's endpoint). Requests
ignore EOS so every request makes its output tokens. Writes service.json, service.md and service_*.png into --out-dir.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from kvpop_eval.provenance import save_report

REPO_ROOT = Path(__file__).resolve().parents[2]
SYSTEMS = ("full", "kvpop", "classic")
COMPRESSION = 0.88
# What a kvpop request asks for: 88% by default; `--kvpop-budget N` asks for N slots per head instead
# (a short chat at 88% gets sinks + window only, where the policy never consults its scorer).
KVPOP_OPTIONS: dict = {"eviction_policy": "kvpop", "compression_ratio": COMPRESSION}


def request_options(system: str) -> dict:
    return {"eviction_policy": "full"} if system == "full" else dict(KVPOP_OPTIONS)
REQUEST_TIMEOUT_S = 3 * 3600  # a late user of (c) waits for 7 batches of 4 ahead of it in the classic design; (b) at 7168 tokens runs ~1 h


@dataclass
class Workload:
    name: str
    label: str
    prompt_tokens: int
    output_tokens: int
    concurrencies: tuple[int, ...]
    requests_per_client: int
    pool: bool = False  # served by the small-pool server / the batch-of-4 classic server


@dataclass
class RequestTiming:
    start: float
    token_times: list[float] = field(default_factory=list)
    end: float = 0.0
    tokens: int = 0
    error: str | None = None


def prompts(count: int, tokens: int, vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[1] + [int(t) for t in rng.integers(3, vocab, size=tokens - 1)] for _ in range(count)]


# -- clients -------------------------------------------------------------------------------------


def service_request(url: str, prompt: list[int], max_tokens: int, system: str, timing: RequestTiming | None = None) -> RequestTiming:
    from kvpop_client import KVpopClient

    options = request_options(system)
    timing = timing or RequestTiming(0.0)
    timing.start = time.perf_counter()
    try:
        for chunk in KVpopClient(url, protocol="grpc", timeout=REQUEST_TIMEOUT_S).stream(prompt, max_tokens, ignore_eos=True, **options):
            if chunk.token_ids:
                now = time.perf_counter()
                timing.token_times.extend([now] * len(chunk.token_ids))
                timing.tokens += len(chunk.token_ids)
    except Exception as error:  # counted, reported
        timing.error = f"{type(error).__name__}: {error}"[:300]
    timing.end = time.perf_counter()
    return timing


def complete_request(url: str, prompt: list[int], max_tokens: int, system: str) -> RequestTiming:
    """One complete answer from the product's endpoint (kvpop_service, /v2/models/kvpop_service/infer),
    as the classic design answers: no streaming, every token at the end."""
    from kvpop_client import KVpopClient

    options = request_options(system)
    timing = RequestTiming(start=time.perf_counter())
    try:
        with KVpopClient(url, protocol="grpc", timeout=REQUEST_TIMEOUT_S) as client:
            timing.tokens = len(client.generate(prompt, max_tokens, ignore_eos=True, **options).output_ids)
        timing.token_times = [time.perf_counter()] * timing.tokens
    except Exception as error:  # counted, reported
        timing.error = f"{type(error).__name__}: {error}"[:300]
    timing.end = time.perf_counter()
    return timing


def classic_request(url: str, prompt: list[int], max_tokens: int, system: str) -> RequestTiming:
    timing = RequestTiming(start=time.perf_counter())
    body = json.dumps({"input_ids": prompt, "max_tokens": max_tokens}).encode()
    try:
        request = urllib.request.Request(f"http://{url}/generate", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:
            timing.tokens = len(json.loads(response.read())["output_ids"])
        timing.token_times = [time.perf_counter()] * timing.tokens  # no streaming: every token at the end
    except Exception as error:
        timing.error = f"{type(error).__name__}: {error}"[:300]
    timing.end = time.perf_counter()
    return timing


def closed_loop(call, url: str, system: str, work: list[list[list[int]]], max_tokens: int) -> tuple[list[RequestTiming], float]:
    """One thread per client, each sending its prompts back to back. -> (timings, wall seconds)."""
    timings: list[RequestTiming] = []
    lock = threading.Lock()

    def client(prompts_of_client):
        for prompt in prompts_of_client:
            timing = call(url, prompt, max_tokens, system)
            with lock:
                timings.append(timing)

    start = time.perf_counter()
    threads = [threading.Thread(target=client, args=(chunk,)) for chunk in work]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return timings, time.perf_counter() - start


def summarize(timings: list[RequestTiming], wall: float, streamed: bool) -> dict:
    done = [t for t in timings if t.error is None]
    latencies = [t.end - t.start for t in done]
    ttft = [t.token_times[0] - t.start for t in done if t.token_times]
    gaps = [g for t in done for g in np.diff(t.token_times)] if streamed else []
    percentile = lambda values, q: float(np.percentile(values, q)) if values else None  # noqa: E731
    return {
        "requests": len(timings),
        "errors": len(timings) - len(done),
        "error_examples": sorted({t.error for t in timings if t.error})[:3],
        "wall_s": wall,
        "requests_per_s": len(done) / wall,
        "output_tokens_per_s": sum(t.tokens for t in done) / wall,
        "ttft_p50_ms": percentile(ttft, 50) and percentile(ttft, 50) * 1e3,
        "itl_p50_ms": percentile(gaps, 50) and percentile(gaps, 50) * 1e3,
        "itl_p99_ms": percentile(gaps, 99) and percentile(gaps, 99) * 1e3,
        "latency_p50_ms": percentile(latencies, 50) and percentile(latencies, 50) * 1e3,
        "latency_p95_ms": percentile(latencies, 95) and percentile(latencies, 95) * 1e3,
        "latency_p99_ms": percentile(latencies, 99) and percentile(latencies, 99) * 1e3,
    }


def stall_probe(url: str, system: str, vocab: int, stream_tokens: int) -> dict:
    """4 running streams; a 2048-token prompt arrives once they run; their gaps during its prefill."""
    results = [RequestTiming(0.0) for _ in range(4)]
    streams = prompts(4, 128, vocab, seed=11)
    threads = [threading.Thread(target=service_request, args=(url, streams[i], stream_tokens, system, results[i]))
               for i in range(4)]
    for thread in threads:
        thread.start()
    deadline = time.time() + 60
    while time.time() < deadline and min(len(t.token_times) for t in results) < 20:  # all four decoding
        time.sleep(0.01)
    long = service_request(url, prompts(1, 2048, vocab, seed=12)[0], 4, system)
    for thread in threads:
        thread.join()
    window = (long.start, long.token_times[0] if long.token_times else long.end)
    ratios, mean_ratios, worst_gap = [], [], 0.0
    for timing in results:
        times = np.array(timing.token_times)
        gaps = np.diff(times)
        if len(gaps) < 3:
            continue
        inside = gaps[(times[1:] >= window[0]) & (times[:-1] <= window[1])]
        if len(inside):
            worst_gap = max(worst_gap, float(inside.max()))
            ratios.append(float(inside.max() / np.median(gaps)))
            # Under load the client may receive several tokens at once (gaps of ~0), which pulls the
            # median gap to nothing: the mean gap (stream time / tokens) is the sturdier reference.
            mean_ratios.append(float(inside.max() / gaps.mean()))
    return {
        "long_prompt_ttft_ms": (window[1] - window[0]) * 1e3,
        "worst_gap_ms": worst_gap * 1e3,
        "median_gap_ms": float(np.median([np.median(np.diff(t.token_times)) for t in results if len(t.token_times) > 2])) * 1e3,
        "worst_gap_over_median": max(ratios) if ratios else None,
        "mean_gap_ms": float(np.mean([np.mean(np.diff(t.token_times)) for t in results if len(t.token_times) > 2])) * 1e3,
        "worst_gap_over_mean": max(mean_ratios) if mean_ratios else None,
    }


# -- servers -------------------------------------------------------------------------------------


def start_triton(model_dir: Path, root: Path, parameters: dict[str, str], log: Path, config_name: str | None = "cpu"):
    """`config_name`: the kvpop_engine config (`cpu`, `single_gpu`, None for the two-GPU config.pbtxt)."""
    from export.repository import assemble_model_repository
    from kvpop.serving.process.tritonserver import TritonServer, free_port

    assemble_model_repository(root, model_dir, parameters)
    server = TritonServer(
        model_repository=root, http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(),
        address="127.0.0.1", model_config_name=config_name, log_file=log,
    )
    server.start().wait_ready()
    return server


def start_classic(hf_model: Path, max_batch: int, log: Path, dtype: str):
    from kvpop.serving.process.tritonserver import free_port

    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "kvpop_eval.bench.classic_server", "--model", str(hf_model), "--port", str(port),
         "--max-batch", str(max_batch), "--threads", str(os.cpu_count() or 2), "--device", "auto", "--dtype", dtype],
        cwd=REPO_ROOT, stdout=log.open("w"), stderr=subprocess.STDOUT,
    )
    return process, wait_healthy(process, port, log, "classic server", timeout=120)


def stop_server_process(process: subprocess.Popen, grace: float = 30.0) -> None:
    """Terminate a server process started here; killed if still busy (inside a long generate call) after `grace` s."""
    process.terminate()
    try:
        process.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def wait_healthy(process: subprocess.Popen, port: int, log: Path, name: str, timeout: float) -> str:
    """Wait until the HTTP server `process` started answers 200 on 127.0.0.1:`port`/health -> "host:port".
    RuntimeError (its log's tail) if it exits first or is not healthy within `timeout` s (it is then killed)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
                if response.status == 200:
                    return f"127.0.0.1:{port}"
        except Exception:
            if process.poll() is not None:
                raise RuntimeError(f"{name} exited: {log.read_text()[-2000:]}") from None
        time.sleep(0.5)
    process.kill()
    raise RuntimeError(f"{name} did not become healthy in {timeout:.0f} s")


# -- report --------------------------------------------------------------------------------------


def report_systems(report: dict) -> tuple[str, ...]:
    """The systems a report measured (reports written before --systems measured all three)."""
    return tuple(report.get("systems", SYSTEMS))


def mean_of(cells: list[dict], key: str):
    values = [cell[key] for cell in cells if isinstance(cell.get(key), (int, float))]
    return statistics.fmean(values) if values else None


def markdown(report: dict) -> str:
    fmt = lambda v, spec=".1f": "-" if v is None else format(v, spec)  # noqa: E731
    lines = [f"Measured {report['date']} on {report['machine']}; model {report['model']}; "
             f"{report['repetitions']} interleaved repetitions, means shown. CPU-sized: each cell is a few requests.\n"]
    if report.get("kvpop_budget") is not None:
        lines.append(f"kvpop requests ask for kv_budget {report['kvpop_budget']} slots per head (not 88% compression).\n")
    if report.get("service_responses") == "complete":
        lines.append("Service requests: complete answers from kvpop_service (no streaming, as the classic design), "
                     "so TTFT is the whole latency and there are no inter-token gaps.\n")
    for workload in report["workloads"]:
        lines.append(f"\n### ({workload['name']}) {workload['label']}\n")
        lines.append("| concurrency | system | req/s | output tok/s | TTFT p50 ms | ITL p50 ms | ITL p99 ms | latency p50 / p95 / p99 ms | errors |")
        lines.append("|---|---|---|---|---|---|---|---|---|")
        for concurrency in workload["concurrencies"]:
            for system in report_systems(report):
                cells = report["cells"][workload["name"]][str(concurrency)][system]
                m = {key: mean_of(cells, key) for key in cells[0]}
                lines.append(
                    f"| {concurrency} | {system} | {fmt(m['requests_per_s'], '.2f')} | {fmt(m['output_tokens_per_s'])} | "
                    f"{fmt(m['ttft_p50_ms'])} | {fmt(m['itl_p50_ms'])} | {fmt(m['itl_p99_ms'])} | "
                    f"{fmt(m['latency_p50_ms'], '.0f')} / {fmt(m['latency_p95_ms'], '.0f')} / {fmt(m['latency_p99_ms'], '.0f')} | "
                    f"{sum(c['errors'] for c in cells)} |"
                )
        lines.append("")
        lines.append("| concurrency | kvpop / full (req/s) | kvpop / full (tok/s) | kvpop / classic (tok/s) | full / classic (req/s) |")
        lines.append("|---|---|---|---|---|")
        for concurrency, ratio in report["ratios"][workload["name"]].items():
            lines.append(f"| {concurrency} | {fmt(ratio['kvpop_over_full_rps'], '.2f')} | {fmt(ratio['kvpop_over_full_tps'], '.2f')} | "
                         f"{fmt(ratio['kvpop_over_classic_tps'], '.2f')} | {fmt(ratio['full_over_classic_rps'], '.2f')} |")
    if not any(report["stall"].values()):  # --stall-tokens 0
        return "\n".join(lines) + "\n"
    lines.append(f"\n### stall: a 2048-token prompt arrives while 4 streams decode (engine parameters {report['engine_parameters']})\n")
    lines.append("| system | worst gap while it is prefilled ms | median gap ms | worst / median | mean gap ms | worst / mean | its TTFT ms |")
    lines.append("|---|---|---|---|---|---|---|")
    for system, probes in report["stall"].items():
        lines.append(f"| {system} | {fmt(mean_of(probes, 'worst_gap_ms'))} | {fmt(mean_of(probes, 'median_gap_ms'))} | "
                     f"{fmt(mean_of(probes, 'worst_gap_over_median'), '.2f')} | {fmt(mean_of(probes, 'mean_gap_ms'))} | "
                     f"{fmt(mean_of(probes, 'worst_gap_over_mean'), '.2f')} | {fmt(mean_of(probes, 'long_prompt_ttft_ms'), '.0f')} |")
    return "\n".join(lines) + "\n"


def ratios(report: dict) -> None:
    report["ratios"] = {}
    for workload in report["workloads"]:
        by = report["cells"][workload["name"]]
        report["ratios"][workload["name"]] = {}
        for concurrency in workload["concurrencies"]:
            cells = by[str(concurrency)]
            get = lambda system, key: mean_of(cells.get(system, []), key)  # noqa: E731
            divide = lambda a, b: a / b if a is not None and b else None  # noqa: E731
            report["ratios"][workload["name"]][str(concurrency)] = {
                "kvpop_over_full_rps": divide(get("kvpop", "requests_per_s"), get("full", "requests_per_s")),
                "kvpop_over_full_tps": divide(get("kvpop", "output_tokens_per_s"), get("full", "output_tokens_per_s")),
                "kvpop_over_classic_tps": divide(get("kvpop", "output_tokens_per_s"), get("classic", "output_tokens_per_s")),
                "full_over_classic_rps": divide(get("full", "requests_per_s"), get("classic", "requests_per_s")),
            }


def plot(report: dict, out_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = report["workloads"]
    if not workloads:  # --workloads none: the stall probe alone, nothing to plot
        return
    figure, axes = plt.subplots(1, len(workloads), figsize=(4.2 * len(workloads), 3.6))
    for axis, workload in zip(np.atleast_1d(axes), workloads):
        concurrencies = workload["concurrencies"]
        width = 0.8 / len(report_systems(report))
        for index, system in enumerate(report_systems(report)):
            values = [mean_of(report["cells"][workload["name"]][str(c)][system], "output_tokens_per_s") or 0 for c in concurrencies]
            axis.bar(np.arange(len(concurrencies)) + index * width, values, width, label=system)
        axis.set_xticks(np.arange(len(concurrencies)) + width, [str(c) for c in concurrencies])
        axis.set_xlabel("concurrent clients")
        axis.set_title(f"({workload['name']}) {workload['label']}", fontsize=8)
    np.atleast_1d(axes)[0].set_ylabel("output tokens/s")
    np.atleast_1d(axes)[0].legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(out_dir / "service_throughput.png", dpi=110)
    plt.close(figure)


# -- main ----------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help="exported model directory (python -m export)")
    parser.add_argument("--hf-model", type=Path, required=True, help="the same model as a Hugging Face directory (classic design)")
    parser.add_argument("--out-dir", type=Path, default=REPO_ROOT / "build" / "results" / "service-reference")
    parser.add_argument("--repetitions", type=int, default=2)
    parser.add_argument("--reason-tokens", type=int, default=1024, help="output tokens of workload (b)")
    parser.add_argument("--pool-tokens", type=int, default=256, help="output tokens of workload (c)")
    parser.add_argument("--pool-users", type=int, nargs="+", default=[16], help="concurrent users of workload (c)")
    parser.add_argument("--reason-concurrency", type=int, nargs="+", default=[4, 8], help="concurrencies of workload (b)")
    parser.add_argument("--stall-tokens", type=int, default=1000, help="output tokens of the stall probe's running streams (0: no stall probe)")
    parser.add_argument("--service-responses", choices=["stream", "complete"], default="stream",
                        help="stream: gRPC streaming from kvpop_engine (TTFT, inter-token gaps); complete: one answer per "
                             "request from kvpop_service, as the classic design answers")
    parser.add_argument("--workloads", nargs="+", default=["a", "b", "c", "d"], help="a b c d, or none (the stall probe only)")
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS),
                        help="systems to measure (default all three; a long run may leave out one measured before)")
    parser.add_argument("--engine-parameter", action="append", default=[], metavar="KEY=VALUE",
                        help="a kvpop_engine config.pbtxt parameter for both servers (repeatable)")
    parser.add_argument("--model-config", default="auto", choices=["auto", "cpu", "single_gpu", "two_gpu"],
                        help="kvpop_engine config: auto picks by the GPUs nvidia-smi lists, as `make serve` does")
    parser.add_argument("--kvpop-budget", type=int, default=None,
                        help="kvpop requests ask for this many slots per head instead of 88%% compression")
    args = parser.parse_args(argv)
    if args.kvpop_budget is not None:
        KVPOP_OPTIONS.pop("compression_ratio")
        KVPOP_OPTIONS["kv_budget"] = args.kvpop_budget

    from kvpop.model_spec import ModelSpec
    from kvpop.serving.process.tritonserver import choose_model_config, count_gpus

    systems = tuple(system for system in SYSTEMS if system in args.systems)  # the canonical order
    gpus = count_gpus()
    config_name = {"auto": choose_model_config(gpus), "two_gpu": None}.get(args.model_config, args.model_config)

    spec = ModelSpec.load(args.model)
    all_workloads = {
        "a": Workload("a", "2048-token prompts, 32 output tokens", 2048, 32, (1, 4, 8), 2),
        "b": Workload("b", f"512-token prompts, {args.reason_tokens} output tokens", 512, args.reason_tokens, tuple(args.reason_concurrency), 1),
        "c": Workload("c", f"many users, 512-token prompts, {args.pool_tokens} output tokens, KV pool of 4 full sequences",
                      512, args.pool_tokens, tuple(args.pool_users), 1, pool=True),
        "d": Workload("d", "~100-token chat prompts, 32 output tokens", 100, 32, (1, 4, 8), 3),
    }
    workloads = [all_workloads[name] for name in args.workloads if name != "none"]
    base_parameters = dict(item.split("=", 1) for item in args.engine_parameter)
    base_parameters.setdefault("max_output_tokens", str(max(1024, args.reason_tokens, args.pool_tokens)))
    cpu_config = (REPO_ROOT / "model_repository" / "kvpop_engine" / "configs" / "cpu.pbtxt").read_text()
    if '"session_hot_mb"' in cpu_config:  # no finished sessions held in the KV pool: admission alone decides
        base_parameters.setdefault("session_hot_mb", "0")
    pool_tokens = 512 + args.pool_tokens
    pool_mb = max(1, math.ceil(4 * pool_tokens * spec.kv_bytes_per_token / 2**20))
    pool_parameters = {**base_parameters, "kv_pool_mb": str(pool_mb)}
    # memory, not the in-flight batch limit, decides how many sequences of workload (c) run at once
    pool_parameters.setdefault("max_running_sequences", str(max(16, *args.pool_users)))
    print(f"[bench] pool workload: kv_pool_mb={pool_mb} ({4 * pool_tokens * spec.kv_bytes_per_token / 2**20:.2f} MiB "
          f"needed by 4 full-cache sequences of {pool_tokens} tokens)", flush=True)

    scratch = Path(tempfile.mkdtemp(prefix="bench-service-"))
    servers, classics = {}, {}
    try:
        servers["main"] = start_triton(args.model, scratch / "repo-main", base_parameters, scratch / "triton-main.log", config_name)
        measure_classic = "classic" in systems
        if measure_classic:
            classics["main"] = start_classic(args.hf_model, 8, scratch / "classic-main.log", spec.dtype)
        if any(w.pool for w in workloads):
            servers["pool"] = start_triton(args.model, scratch / "repo-pool", pool_parameters, scratch / "triton-pool.log", config_name)
            if measure_classic:
                classics["pool"] = start_classic(args.hf_model, 4, scratch / "classic-pool.log", spec.dtype)
        urls = {key: (server.grpc_url, classics[key][1] if measure_classic else None) for key, server in servers.items()}

        for key, (grpc_url, classic_url) in urls.items():  # warm up every system
            warm = prompts(1, 256, spec.vocab_size, seed=99)[0]
            for system in ("full", "kvpop"):
                service_request(grpc_url, warm, 4, system)
            if measure_classic:
                classic_request(classic_url, warm, 4, "classic")

        streamed = args.service_responses == "stream"
        cells: dict = {w.name: {str(c): {s: [] for s in systems} for c in w.concurrencies} for w in workloads}
        stall: dict = {"full": [], "kvpop": []}
        for repetition in range(args.repetitions):
            for workload in workloads:
                grpc_url, classic_url = urls["pool" if workload.pool else "main"]
                for concurrency in workload.concurrencies:
                    seed = 1000 * repetition + concurrency
                    work = [prompts(workload.requests_per_client, workload.prompt_tokens, spec.vocab_size, seed + 17 * client)
                            for client in range(concurrency)]
                    order = systems if repetition % 2 == 0 else tuple(reversed(systems))
                    for system in order:
                        service_call = service_request if streamed else complete_request
                        call, url = (classic_request, classic_url) if system == "classic" else (service_call, grpc_url)
                        timings, wall = closed_loop(call, url, system, work, workload.output_tokens)
                        cell = summarize(timings, wall, streamed=streamed and system != "classic")
                        cells[workload.name][str(concurrency)][system].append(cell)
                        print(f"[bench] rep {repetition + 1} ({workload.name}) c={concurrency} {system}: "
                              f"{cell['requests_per_s']:.2f} req/s, {cell['output_tokens_per_s']:.0f} tok/s, "
                              f"TTFT p50 {cell['ttft_p50_ms'] or 0:.0f} ms, ITL p50 {cell['itl_p50_ms'] or 0:.1f} ms, "
                              f"p99 {cell['latency_p99_ms'] or 0:.0f} ms, errors {cell['errors']} {cell['error_examples']}", flush=True)
            for system in ("full", "kvpop") if args.stall_tokens > 0 else ():
                probe = stall_probe(urls["main"][0], system, spec.vocab_size, stream_tokens=args.stall_tokens)
                stall[system].append(probe)
                print(f"[bench] rep {repetition + 1} stall {system}: {probe}", flush=True)
    finally:
        for server in servers.values():
            server.stop()
        for process, _ in classics.values():
            stop_server_process(process)
        shutil.rmtree(scratch, ignore_errors=True)  # model repositories hold copies of the weights

    report = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs (shared), " + (f"{gpus} GPU(s)" if gpus else "no GPU"),
        "model_config": config_name or "config.pbtxt (two GPUs)",
        "model": str(args.model),
        "hf_model": str(args.hf_model),
        "repetitions": args.repetitions,
        "systems": list(systems),
        "service_responses": args.service_responses,
        "compression": KVPOP_OPTIONS.get("compression_ratio"),
        "kvpop_budget": KVPOP_OPTIONS.get("kv_budget"),
        "engine_parameters": base_parameters,
        "pool_kv_mb": pool_mb,
        "workloads": [asdict(w) for w in workloads],
        "cells": cells,
        "stall": stall,
    }
    ratios(report)
    save_report(args.out_dir, "service", report, markdown(report), plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
