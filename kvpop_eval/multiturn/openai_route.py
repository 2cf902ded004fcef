"""Chats through the OpenAI-compatible API of a real server, as an OpenAI client holds a chat: every turn
re-sends the whole conversation (the replies as the server gave them) to POST /v1/chat/completions, with
the KVpop controls in `extra_body` (`eviction_policy`, `compression_ratio`), and no session: the engine
prefills each turn's whole conversation and compresses it to `ceil((1 - r) * (prompt + max_tokens))` slots.

The server is the one at `--openai-url` (`make serve-bg`: http://localhost:9000), or one this module starts
on free ports from the model repository (tritonserver and `python -m kvpop.openai_api`) and stops after.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterator

from kvpop_eval.multiturn.chats import answered

MODEL = "kvpop_engine"
CONCURRENT_CHATS = 8


def _wait_healthy(url: str, process: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the OpenAI API exited with code {process.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"the OpenAI API at {url} was not healthy after {timeout:.0f} s")


@contextlib.contextmanager
def started_api(triton_grpc: str, log_dir: Path) -> Iterator[str]:
    """`python -m kvpop.openai_api` on a free port before the Triton server at `triton_grpc`; yields its URL."""
    from kvpop.serving.process.tritonserver import free_port

    log_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    with open(log_dir / "openai_api.log", "ab") as log:
        api = subprocess.Popen([sys.executable, "-m", "kvpop.openai_api", "--port", str(port), "--triton-grpc", triton_grpc],
                               stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            url = f"http://127.0.0.1:{port}"
            _wait_healthy(url, api)
            yield url
        finally:
            api.terminate()
            api.wait(30)


@contextlib.contextmanager
def started_server(model_repository: Path, log_dir: Path) -> Iterator[str]:
    """tritonserver on the model repository (its CPU config) and the OpenAI API beside it, on free ports;
    yields the API's URL."""
    from kvpop.serving.process.tritonserver import TritonServer, free_port

    log_dir.mkdir(parents=True, exist_ok=True)
    server = TritonServer(model_repository=model_repository, http_port=free_port(), grpc_port=free_port(),
                          metrics_port=free_port(), address="127.0.0.1", model_config_name="cpu", state_dir=log_dir / "state",
                          log_file=log_dir / "tritonserver.log")
    with server, started_api(server.grpc_url, log_dir) as url:
        yield url


def run_chat(client, chat: dict, controls: dict, reply_tokens: int, answer_tokens: int) -> dict:
    """One chat, turn by turn, the whole conversation sent each time; the row of its answer."""
    messages = [{"role": "system", "content": chat["system"]}] if chat.get("system") is not None else []
    replies = []
    for turn, user in enumerate(chat["users"]):
        messages.append({"role": "user", "content": user})
        last = turn == len(chat["users"]) - 1
        reply = client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                               max_tokens=answer_tokens if last else reply_tokens, extra_body=controls)
        text = reply.choices[0].message.content or ""
        messages.append({"role": "assistant", "content": text})
        replies.append(text)
    statistics = reply.model_extra["kvpop"]
    return {"index": chat["index"], "correct": answered(replies[-1], chat), "generated": replies[-1], "replies": replies[:-1],
            "tokens_seen": reply.usage.total_tokens, "budget": statistics["kv_budget"], "compression": statistics["compression"],
            "peak_kv_bytes": statistics["peak_kv_bytes"]}


def run_chats(url: str, chats: list[dict], policy: str, compression: float, reply_tokens: int, answer_tokens: int,
              on_row: Callable[[dict], None]) -> None:
    """`chats` under one policy, CONCURRENT_CHATS at a time; `on_row(row)` as each chat ends."""
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=5, timeout=900)
    controls = {"eviction_policy": policy, **({} if policy == "full" else {"compression_ratio": compression})}
    lock = threading.Lock()

    def one(chat: dict) -> None:
        row = run_chat(client, chat, controls, reply_tokens, answer_tokens)
        with lock:
            on_row(row)

    with ThreadPoolExecutor(CONCURRENT_CHATS) as pool:
        for future in [pool.submit(one, chat) for chat in chats]:
            future.result()
