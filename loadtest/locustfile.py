"""Locust load run against kvpop_service over HTTP (default) or gRPC.

    make loadtest                       # headless, writes build/results/loadtest/ (CSV + HTML report)
    .venv/bin/locust -f loadtest/locustfile.py --host http://127.0.0.1:8000          # web UI

Environment: KVPOP_PROTOCOL=http|grpc, KVPOP_GRPC_URL (default 127.0.0.1:8001), KVPOP_MAX_TOKENS,
KVPOP_POLICY (eviction policy), KVPOP_KV_BUDGET, KVPOP_PROMPT_TOKENS (approximate prompt length).
"""

from __future__ import annotations

import os
import random
import time

PROTOCOL = os.environ.get("KVPOP_PROTOCOL", "http")
if PROTOCOL == "grpc":
    # Without this, gRPC users under gevent run one request at a time, silently.
    import grpc.experimental.gevent as grpc_gevent

    grpc_gevent.init_gevent()

from locust import User, between, events, task  # noqa: E402

from kvpop_client import KVpopClient, KVpopClientError  # noqa: E402

MAX_TOKENS = int(os.environ.get("KVPOP_MAX_TOKENS", "32"))
POLICY = os.environ.get("KVPOP_POLICY") or None
KV_BUDGET = int(os.environ["KVPOP_KV_BUDGET"]) if os.environ.get("KVPOP_KV_BUDGET") else None
PROMPT_WORDS = int(os.environ.get("KVPOP_PROMPT_TOKENS", "64"))
WORDS = "the cache keeps sinks a recent window and long range slots chosen by a learned scorer".split()


def random_prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(PROMPT_WORDS))


class KVpopUser(User):
    wait_time = between(0.05, 0.2)

    def on_start(self) -> None:
        host = self.host or "http://127.0.0.1:8000"
        url = host.split("://", 1)[-1] if PROTOCOL == "http" else os.environ.get("KVPOP_GRPC_URL", "127.0.0.1:8001")
        self.client = KVpopClient(url, PROTOCOL)
        self.rng = random.Random()

    def on_stop(self) -> None:
        self.client.close()

    @task
    def generate(self) -> None:
        start = time.perf_counter()
        name = f"{PROTOCOL} generate {POLICY or 'default'}"
        try:
            result = self.client.generate(
                random_prompt(self.rng), max_tokens=MAX_TOKENS, eviction_policy=POLICY, kv_budget=KV_BUDGET
            )
        except KVpopClientError as error:
            events.request.fire(request_type="infer", name=name, response_time=(time.perf_counter() - start) * 1000,
                                response_length=0, exception=error)
            return
        events.request.fire(request_type="infer", name=name, response_time=(time.perf_counter() - start) * 1000,
                            response_length=result.num_output_tokens, exception=None)
