"""OpenAI API benchmark (a program, not a test): AIPerf against the OpenAI-compatible API, and the
route's own cost against Triton's generate_stream, on a running server (`make serve-bg`).

    python -m kvpop_eval.bench.openai --aiperf .venv-aiperf/bin/aiperf --out-dir build/results/openai   # make bench-openai

1. AIPerf, unchanged, streams chat completions at `--concurrency` for the full cache and for kvpop at 88%
   (the KVpop controls go in as `--extra-inputs`); its reports land in <out-dir>/aiperf-<system>/ and
   the TTFT / ITL / throughput figures in openai.json.
2. The OpenAI route's extra latency: the same chat, one request at a time, alternately through
   POST /v1/chat/completions (stream) and Triton's POST /v2/models/kvpop_engine/generate_stream (the
   engine's own SSE route, the prompt sent as `messages`); medians of time to first token and of the
   whole request, and their differences.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from kvpop_eval.provenance import stamp
from kvpop_eval.timing import interleaved

SYSTEMS = {"full": {"eviction_policy": "full"}, "kvpop-88": {"eviction_policy": "kvpop", "compression_ratio": 0.88}}
MODEL = "kvpop_engine"
PROMPT = ("Summarise in two sentences why a bounded key-value cache lets a language model server keep many "
          "long conversations in memory at once.")


def run_aiperf(args: argparse.Namespace, system: str, controls: dict) -> dict:
    out = args.out_dir / f"aiperf-{system}"
    extras = [item for key, value in {**controls, "ignore_eos": "true"}.items()
              for item in ("--extra-inputs", f"{key}:{value}")]
    command = [args.aiperf, "profile", "-m", MODEL, "--url", args.openai_url, "--endpoint-type", "chat",
               "--streaming", "--tokenizer", str(args.tokenizer), "--use-server-token-count",
               "--prompt-input-tokens-mean", str(args.input_tokens), "--prompt-input-tokens-stddev", "0",
               "--prompt-output-tokens-mean", str(args.output_tokens), "--prompt-output-tokens-stddev", "0",
               "--request-count", str(args.requests), "--concurrency", str(args.concurrency),
               "--random-seed", "1", *extras, "--output-artifact-dir", str(out)]
    print(f"[bench-openai] aiperf, {system}: {args.requests} requests at concurrency {args.concurrency}", flush=True)
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    report = json.loads((out / "profile_export_aiperf.json").read_text())
    return {
        "command": command,
        "ttft_ms": {q: report["time_to_first_token"][q] for q in ("p50", "p90", "p99")},
        "itl_ms": {q: report["inter_token_latency"][q] for q in ("p50", "p90", "p99")},
        "output_tokens_per_s": report["output_token_throughput"]["avg"],
        "requests_per_s": report["request_throughput"]["avg"],
        "request_latency_ms_p50": report["request_latency"]["p50"],
        "errors": (report.get("error_summary") or []),
    }


def sse_request(url: str, body: dict) -> tuple[float, float]:
    """(seconds to the first data event with text, seconds to the end) of one SSE request."""
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    started, first = time.perf_counter(), None
    with urllib.request.urlopen(request, timeout=600) as response:
        for line in response:
            if first is None and line.startswith(b"data: {") and (b'"content":"' in line or b'"text_output":"' in line):
                first = time.perf_counter() - started
    return first if first is not None else float("nan"), time.perf_counter() - started


def route_overhead(args: argparse.Namespace) -> dict:
    """The OpenAI route against the engine's generate_stream, interleaved, on the same chat."""
    messages = [{"role": "user", "content": PROMPT}]
    openai_body = {"model": MODEL, "messages": messages, "max_tokens": args.output_tokens, "stream": True,
                   "ignore_eos": True, "temperature": 0}
    triton_body = {"messages": json.dumps(messages), "max_tokens": args.output_tokens, "stream": True,
                   "ignore_eos": True}
    routes = {"openai": (args.openai_url + "/v1/chat/completions", openai_body),
              "generate_stream": (f"{args.triton_http_url}/v2/models/{MODEL}/generate_stream", triton_body)}
    print(f"[bench-openai] route overhead: {args.overhead_requests} requests per route, interleaved", flush=True)
    samples = interleaved({name: lambda url=url, body=body: sse_request(url, body) for name, (url, body) in routes.items()},
                          args.overhead_requests, alternate=False)
    medians = {name: {"ttft_ms": 1000 * statistics.median(ttft for _, (ttft, _) in values),
                      "latency_ms": 1000 * statistics.median(latency for _, (_, latency) in values)}
               for name, values in samples.items()}
    return {
        "requests_per_route": args.overhead_requests,
        "output_tokens": args.output_tokens,
        "median": medians,
        "extra_ttft_ms": medians["openai"]["ttft_ms"] - medians["generate_stream"]["ttft_ms"],
        "extra_latency_ms": medians["openai"]["latency_ms"] - medians["generate_stream"]["latency_ms"],
        "latency_ratio": medians["openai"]["latency_ms"] / medians["generate_stream"]["latency_ms"],
    }


def markdown(result: dict) -> str:
    lines = ["| system | TTFT p50 / p99 ms | ITL p50 / p99 ms | output tok/s | req/s |", "|---|---|---|---|---|"]
    for system, row in result["aiperf"].items():
        lines.append(f"| {system} | {row['ttft_ms']['p50']:.0f} / {row['ttft_ms']['p99']:.0f} | "
                     f"{row['itl_ms']['p50']:.1f} / {row['itl_ms']['p99']:.1f} | {row['output_tokens_per_s']:.1f} | "
                     f"{row['requests_per_s']:.2f} |")
    overhead = result["route_overhead"]
    lines += ["", "| route (median of interleaved requests) | TTFT ms | latency ms |", "|---|---|---|"]
    for name, row in overhead["median"].items():
        lines.append(f"| {name} | {row['ttft_ms']:.1f} | {row['latency_ms']:.1f} |")
    lines.append(f"\nThe OpenAI route adds {overhead['extra_ttft_ms']:.1f} ms to the first token and "
                 f"{overhead['extra_latency_ms']:.1f} ms to a request ({overhead['latency_ratio']:.3f}x).")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvpop_eval.bench.openai", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--aiperf", default=".venv-aiperf/bin/aiperf")
    parser.add_argument("--openai-url", default="http://127.0.0.1:9000")
    parser.add_argument("--triton-http-url", default="http://127.0.0.1:8000")
    parser.add_argument("--tokenizer", type=Path, default=Path("model_repository/kvpop_engine/1/tokenizer"))
    parser.add_argument("--input-tokens", type=int, default=512)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--overhead-requests", type=int, default=10)
    parser.add_argument("--out-dir", type=Path, default=Path("build/results/openai"))
    args = parser.parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    result = stamp({"aiperf": {system: run_aiperf(args, system, controls) for system, controls in SYSTEMS.items()},
                    "route_overhead": route_overhead(args)})
    (args.out_dir / "openai.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out_dir / "openai.md").write_text(markdown(result))
    print(markdown(result))
    print(f"[bench-openai] wrote {args.out_dir / 'openai.json'} and openai.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
