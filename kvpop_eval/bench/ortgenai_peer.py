"""The second CPU peer: ONNX Runtime GenAI (`onnxruntime-genai`, Microsoft's generate() API on onnxruntime),
SmolLM2 built by the library's own model builder at fp32 (the values the exported ONNX model holds) and at
int4 (weight-only int4 MatMuls, what its CPU users run), served by kvpop_eval.bench.ortgenai_server.

Why a server of our own: the library ships none, so the peer is the smallest one a user would write on its
`Engine`; on CPU that engine batches statically (ortgenai_server says how), and that is what the peer
offers. `make ortgenai-peer` creates its own environment, build/ortgenai/venv (requirements/ortgenai.txt:
the library, and the builder's torch and transformers), and builds both models into build/ortgenai/<precision>/.
"""

from __future__ import annotations

import json
from pathlib import Path

from kvpop_eval.bench import peers
from kvpop_eval.bench.service import REPO_ROOT, RequestTiming

ORTGENAI_DIR = REPO_ROOT / "build" / "ortgenai"
ORTGENAI_PYTHON = ORTGENAI_DIR / "venv" / "bin" / "python"
PRECISIONS = ("fp32", "int4")


def model_dir(precision: str) -> Path:
    """The builder's output for `precision`; FileNotFoundError until `make ortgenai-peer` has made it."""
    directory = ORTGENAI_DIR / precision
    if not ORTGENAI_PYTHON.exists() or not (directory / "genai_config.json").exists():
        raise FileNotFoundError(f"no ONNX Runtime GenAI model in {directory}: run `make ortgenai-peer`")
    return directory


def start_ortgenai(model: Path, max_batch: int, max_length: int, threads: int, log: Path, port: int):
    """kvpop_eval.bench.ortgenai_server on 127.0.0.1:`port` in the peer's environment: static batches of up
    to `max_batch` requests of up to `max_length` tokens each. -> (process, "host:port")."""
    command = [str(ORTGENAI_PYTHON), "-m", "kvpop_eval.bench.ortgenai_server", "--model", str(model), "--port", str(port),
               "--max-batch", str(max_batch), "--max-length", str(max_length), "--threads", str(threads)]
    return peers.start_server(command, log, port, "onnxruntime-genai server")


def ortgenai_request(url: str, prompt: list[int], max_tokens: int, system: str) -> RequestTiming:
    """One streamed generation from the prompt's token ids (greedy, exactly `max_tokens` tokens, no prompt
    reuse): a timestamp per token as the server sends it."""
    return peers.streamed_request(f"http://{url}/generate", {"input_ids": prompt, "max_tokens": max_tokens}, tokens_in_line)


def tokens_in_line(line: bytes, counted: int) -> int:
    """One token per {"token": id} line; an {"error": ...} line fails the request."""
    message = json.loads(line)
    if "error" in message:
        raise RuntimeError(message["error"])
    return int("token" in message)
