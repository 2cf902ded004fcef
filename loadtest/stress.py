"""Closed-loop stress of a running server: C clients send N requests in all, and every answer is checked.

    python -m loadtest.stress --url 127.0.0.1:8000 --requests 400 --concurrency 8 \
        --policy kvpop --compression-ratio 0.88 --prompt-tokens 2048 --max-tokens 32

Each request must end in a complete answer or a clear, correctly coded error (400 / INVALID_ARGUMENT
for a client mistake, 503 / UNAVAILABLE for overload); anything else (500, a hang past --timeout, a
dropped connection) is counted as lost. A stub that dies shows up as lost requests, and as a server log
line when --log is given. Prints progress and a JSON summary; the exit status is 1 when any request
was lost. Used by `make stress` and, at small scale, by the test suite.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvpop_client import KVpopClient, KVpopClientError

CRASH_MARKERS = ("double free", "free():", "malloc():", "corrupted", "lock_exception", "not healthy", "Signal (")


@dataclass
class StressSummary:
    requests: int
    concurrency: int
    protocol: str
    policy: str | None
    completed: int = 0
    rejected: dict[str, int] = field(default_factory=dict)  # error kind -> count (expected under overload)
    lost: dict[str, int] = field(default_factory=dict)  # what must never happen
    seconds: float = 0.0
    crash_log_lines: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.lost and not self.crash_log_lines


def classify(error: KVpopClientError) -> tuple[bool, str]:
    """(expected, label): overload rejections are expected under saturation, anything else is lost."""
    status = getattr(error, "status", None)
    label = f"{status}: {str(error)[:80]}"
    return str(status).removeprefix("StatusCode.") in ("UNAVAILABLE", "503", "429", "RESOURCE_EXHAUSTED"), label


def run_stress(
    url: str,
    *,
    requests: int,
    concurrency: int,
    protocol: str = "http",
    prompts: list[str] | None = None,
    policy: str | None = None,
    compression_ratio: float | None = None,
    kv_budget: int | None = None,
    max_tokens: int = 32,
    timeout: float = 300.0,
    log_file: Path | None = None,
    progress_every: int = 50,
) -> StressSummary:
    prompts = prompts or ["Let a = 7. What is a?"]
    summary = StressSummary(requests, concurrency, protocol, policy)
    counter = iter(range(requests))
    lock = threading.Lock()
    done = [0]
    rejected: Counter = Counter()
    lost: Counter = Counter()
    start = time.perf_counter()

    def client_loop(worker: int) -> None:
        rng = random.Random(worker)
        with KVpopClient(url, protocol, timeout=timeout) as client:
            while True:
                with lock:
                    index = next(counter, None)
                if index is None:
                    return
                try:
                    result = client.generate(
                        rng.choice(prompts), max_tokens=max_tokens, eviction_policy=policy,
                        compression_ratio=compression_ratio, kv_budget=kv_budget, ignore_eos=True,
                    )
                    good = result.num_output_tokens == max_tokens and len(result.output_ids) == max_tokens
                    with lock:
                        if good:
                            summary.completed += 1
                        else:
                            lost[f"short answer ({result.num_output_tokens} tokens, {result.finish_reason})"] += 1
                except KVpopClientError as error:
                    expected, label = classify(error)
                    with lock:
                        (rejected if expected else lost)[label] += 1
                except Exception as error:  # connection dropped, timeout: lost
                    with lock:
                        lost[f"{type(error).__name__}: {str(error)[:80]}"] += 1
                with lock:
                    done[0] += 1
                    if progress_every and done[0] % progress_every == 0:
                        rate = done[0] / (time.perf_counter() - start)
                        print(f"[stress] {done[0]}/{requests} done ({rate:.2f} req/s), "
                              f"lost {sum(lost.values())}, rejected {sum(rejected.values())}", flush=True)

    with ThreadPoolExecutor(concurrency) as pool:
        for future in [pool.submit(client_loop, worker) for worker in range(concurrency)]:
            future.result()
    summary.seconds = round(time.perf_counter() - start, 2)
    summary.rejected, summary.lost = dict(rejected), dict(lost)
    if log_file is not None and Path(log_file).exists():
        summary.crash_log_lines = [
            line.strip()[:200] for line in Path(log_file).read_text(errors="replace").splitlines()
            if any(marker in line for marker in CRASH_MARKERS)
        ]
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.stress", description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="127.0.0.1:8000", help="HTTP host:port (or gRPC with --protocol grpc)")
    parser.add_argument("--protocol", choices=("http", "grpc"), default="http")
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--policy", default=None)
    parser.add_argument("--compression-ratio", type=float, default=None)
    parser.add_argument("--kv-budget", type=int, default=None)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=0,
                        help="use the reference task generator's prompts of this many tokens (0: a short prompt)")
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--log", type=Path, default=None, help="server log to scan for stub crashes")
    parser.add_argument("--out", type=Path, default=None, help="write the JSON summary here")
    args = parser.parse_args(argv)

    prompts = None
    if args.prompt_tokens:
        from kvpop_tasks.generator import TaskConfig, generate_task

        config = TaskConfig(context_tokens=args.prompt_tokens)
        prompts = [generate_task(config, "validation", index).prompt for index in range(16)]
    summary = run_stress(
        args.url, requests=args.requests, concurrency=args.concurrency, protocol=args.protocol, prompts=prompts,
        policy=args.policy, compression_ratio=args.compression_ratio, kv_budget=args.kv_budget,
        max_tokens=args.max_tokens, timeout=args.timeout, log_file=args.log,
    )
    report = {**asdict(summary), "ok": summary.ok}
    print(json.dumps(report, indent=2))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0 if summary.ok else 1


if __name__ == "__main__":
    sys.exit(main())
