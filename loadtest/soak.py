"""Soak: mixed streaming and complete requests at saturation for a fixed time, against a real server.

    python -m loadtest.soak --model-repository model_repository --minutes 10 --users 16 --out build/results/soak/soak.json

Starts its own tritonserver (CPU config) on free loopback ports, runs `users` closed-loop clients
(HTTP and gRPC, complete answers and streams, every policy) until the time is up, then checks what a
production soak must show: no request lost (every one answered, or refused with 503 / UNAVAILABLE),
memory of the server and its stubs bounded, and the engine's gauges back to 0 when the load stops.
Prints progress every 30 s and writes a JSON summary; the exit status is 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import psutil

from kvpop.serving.process.tritonserver import TritonServer, free_port
from kvpop_client import KVpopClient, KVpopServerError

POLICIES = ("full", "streaming", "h2o", "tova", "random", "kvpop")
PROMPTS = ["Let a = 7. What is a?", "What is the capital of France? Answer in one sentence.",
           "Let b = 3. Let c = b. " * 20 + "What is c?"]
RETRYABLE = {"503", "UNAVAILABLE", "StatusCode.UNAVAILABLE"}
GAUGES = ("kvpop_active_sequences", "kvpop_queued_sequences", "kvpop_frontend_in_flight_requests")


def server_rss_mb(server: TritonServer) -> dict[str, float]:
    """RSS of tritonserver and of each model's stub, in MB."""
    process = psutil.Process(server.process.pid)
    sizes = {"tritonserver": process.memory_info().rss / 2**20}
    for child in process.children(recursive=True):
        command = child.cmdline()
        name = Path(command[1]).parent.parent.name if len(command) > 1 and "stub" in command[0] else child.name()
        sizes[name] = sizes.get(name, 0.0) + child.memory_info().rss / 2**20
    return {name: round(size, 1) for name, size in sizes.items()}


def gauge_total(metrics_url: str) -> float:
    samples = KVpopClient.metrics(metrics_url)
    return sum(value for key, value in samples.items() if key.split("{", 1)[0] in GAUGES)


def soak(server: TritonServer, seconds: float, users: int, max_tokens: int) -> dict:
    stop_at = time.time() + seconds
    outcomes: Counter = Counter()
    lock = threading.Lock()

    def user(index: int) -> None:
        rng = random.Random(index)
        protocol = ("http", "grpc")[index % 2]
        url = server.http_url if protocol == "http" else server.grpc_url
        with KVpopClient(url, protocol, timeout=300) as client:
            while time.time() < stop_at:
                policy = rng.choice(POLICIES)
                options = {"eviction_policy": policy, "max_tokens": rng.randint(1, max_tokens)}
                if policy != "full":
                    options["compression_ratio"] = rng.choice([0.5, 0.75, 0.88])
                streamed = rng.random() < 0.4
                try:
                    if streamed:
                        chunks = list(client.stream(rng.choice(PROMPTS), **options))
                        good = chunks and chunks[-1].result is not None
                    else:
                        good = client.generate(rng.choice(PROMPTS), **options).num_output_tokens > 0
                    label = "ok" if good else "lost: incomplete answer"
                except KVpopServerError as error:
                    label = "refused (503)" if str(error.status) in RETRYABLE else f"lost: {error.status} {str(error)[:60]}"
                except Exception as error:
                    label = f"lost: {type(error).__name__}"
                with lock:
                    outcomes[f"{'stream' if streamed else 'complete'} {label}"] += 1

    threads = [threading.Thread(target=user, args=(index,), daemon=True) for index in range(users)]
    rss = [server_rss_mb(server)]
    started = time.time()
    for thread in threads:
        thread.start()
    while any(thread.is_alive() for thread in threads):
        time.sleep(min(30.0, max(0.5, stop_at - time.time() + 1)))
        rss.append(server_rss_mb(server))
        with lock:
            done = sum(outcomes.values())
            lost = sum(count for label, count in outcomes.items() if "lost" in label)
        print(f"[soak] {time.time() - started:5.0f} s  {done} requests  lost {lost}  RSS MB {rss[-1]}", flush=True)
    for thread in threads:
        thread.join()
    time.sleep(2)
    gauges = gauge_total(server.metrics_url)
    lost = sum(count for label, count in outcomes.items() if "lost" in label)
    # Growth after warm-up (the first sample is before any request: onnxruntime arenas, caches).
    warm = rss[min(2, len(rss) - 1)]
    growth = {name: round(size - warm.get(name, 0.0), 1) for name, size in rss[-1].items()}
    return {
        "seconds": round(time.time() - started, 1), "users": users, "requests": sum(outcomes.values()),
        "outcomes": dict(outcomes), "lost": lost, "rss_mb": rss, "rss_growth_after_warmup_mb": growth,
        "gauges_after": gauges, "ok": lost == 0 and gauges == 0,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-repository", type=Path, default=Path("model_repository"))
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--users", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--out", type=Path, default=Path("build/results/soak/soak.json"))
    args = parser.parse_args(argv)
    log = Path("run/soak-tritonserver.log")
    server = TritonServer(args.model_repository, free_port(), free_port(), free_port(), "127.0.0.1", "cpu", log)
    with server:
        summary = soak(server, args.minutes * 60, args.users, args.max_tokens)
    print(json.dumps(summary, indent=2))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=2) + "\n")
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
