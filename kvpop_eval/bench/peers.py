"""What the outside CPU peers (kvpop_eval.bench.llamacpp_peer, kvpop_eval.bench.ortgenai_peer) share: a server
process started in its own build and waited on until healthy, and a request streamed over HTTP with a
timestamp per token as its line arrives, so every peer is timed the same way as the engine's gRPC stream.
"""

from __future__ import annotations

import json
import subprocess
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

from kvpop_eval.bench.service import REPO_ROOT, REQUEST_TIMEOUT_S, RequestTiming, wait_healthy

# (a line of the response, tokens counted so far) -> tokens that line adds; raises on an error line
TokenCounter = Callable[[bytes, int], int]


def start_server(command: list[str], log: Path, port: int, name: str, timeout: float = 180):
    """Run `command` from the repository root, its output into `log`; -> (process, "host:port") once it
    answers /health on 127.0.0.1:`port`."""
    process = subprocess.Popen(command, cwd=REPO_ROOT, stdout=log.open("w"), stderr=subprocess.STDOUT)
    return process, wait_healthy(process, port, log, name, timeout=timeout)


def streamed_request(url: str, body: dict, tokens_in: TokenCounter) -> RequestTiming:
    """POST `body` as JSON to `url` and read the streamed answer line by line: each token `tokens_in` finds
    gets the time its line arrived. A failure is recorded in the timing, never raised."""
    timing = RequestTiming(start=time.perf_counter())
    try:
        request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:
            for line in response:
                count = tokens_in(line, timing.tokens)
                if count > 0:
                    timing.token_times.extend([time.perf_counter()] * count)
                    timing.tokens += count
    except Exception as error:  # counted, reported
        timing.error = f"{type(error).__name__}: {error}"[:300]
    timing.end = time.perf_counter()
    return timing
