"""Model load time at server start: how long a node takes from `tritonserver` starting to serving.

    python -m deploy.load_time [--exported-model DIR] [--starts 3] --out build/results/load-time/load_time.json

Starts one tritonserver (CPU config, loopback ports) on the repository's models with an exported model
several times and reports, per start, the seconds from process start to `/v2/health/ready` and each
model's load time from Triton's own log ("loading: M" -> "successfully loaded 'M'"). Without
`--exported-model` it uses `make export`'s output in model_repository/, else exports a tiny Llama.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

from export.repository import assemble_model_repository
from kvpop.serving.process.tritonserver import TritonServer, free_port

REPO_ROOT = Path(__file__).resolve().parents[1]
LOG_TIME = r"^[IWE](\d{4} \d\d:\d\d:\d\d\.\d+) +\d+ \S+\] "


def model_load_seconds(log: str) -> dict[str, float]:
    """Per model, seconds from Triton's 'loading' line to its 'successfully loaded' line."""
    def stamp(text: str) -> datetime:
        return datetime.strptime(text, "%m%d %H:%M:%S.%f")

    started = {m: stamp(t) for t, m in re.findall(LOG_TIME + r'"loading: (\w+):\d+"', log, re.M)}
    loaded = {m: stamp(t) for t, m in re.findall(LOG_TIME + r"\"successfully loaded '(\w+)'\"", log, re.M)}
    return {model: round((loaded[model] - started[model]).total_seconds(), 2) for model in started if model in loaded}


def exported_model(workdir: Path, given: Path | None) -> tuple[Path, str]:
    if given:
        return given, str(given)
    committed = REPO_ROOT / "model_repository" / "kvpop_engine" / "1"
    if (committed / "model_spec.json").exists():
        spec = json.loads((committed / "model_spec.json").read_text())
        return committed, f"model_repository export ({spec.get('source', spec.get('architecture', 'make export'))})"
    from export.pipeline import export_model
    from export.tiny_model import build_tiny_llama

    export_model(build_tiny_llama(workdir / "hf"), workdir / "onnx")
    return workdir / "onnx", "tiny random Llama (no `make export` output here)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deploy.load_time", description=__doc__.split("\n\n")[0])
    parser.add_argument("--exported-model", type=Path)
    parser.add_argument("--starts", type=int, default=3)
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "build" / "results" / "load-time" / "load_time.json")
    args = parser.parse_args(argv)

    workdir = Path(tempfile.mkdtemp(prefix="kvpop-load-time-"))
    try:
        model_dir, model_name = exported_model(workdir / "model", args.exported_model)
        repository = assemble_model_repository(workdir / "model_repository", model_dir)
        starts = []
        for number in range(args.starts):
            log_file = workdir / f"start{number}.log"
            server = TritonServer(repository, free_port(), free_port(), free_port(), "127.0.0.1", "cpu", log_file)
            began = time.monotonic()
            with server:
                ready = round(time.monotonic() - began, 2)
            starts.append({"seconds_start_to_ready": ready, "model_load_seconds": model_load_seconds(log_file.read_text())})
            print(f"start {number + 1}: ready after {ready} s, models {starts[-1]['model_load_seconds']}", flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    report = {
        "model": model_name,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores (shared), no GPU; CPU config",
        "starts": starts,
        "median_seconds_start_to_ready": statistics.median(s["seconds_start_to_ready"] for s in starts),
        "median_engine_load_seconds": statistics.median(s["model_load_seconds"].get("kvpop_engine", float("nan")) for s in starts),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
