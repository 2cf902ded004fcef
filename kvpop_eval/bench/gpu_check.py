"""The first run on a GPU machine, prepared (a program, not a test): export SmolLM2 in float16, check its
parity on onnxruntime's CUDA execution provider, time the decode step's weights/KV split on the GPU,
and serve the single-GPU config under the SmolLM2 service benchmark, everything into one folder.

    python -m kvpop_eval.bench.gpu_check --out-dir build/results/gpu-check        # make gpu-check
    python -m kvpop_eval.bench.gpu_check --plan                                    # print the steps, run none

Each step is a child process with its log in the folder; the run stops at the first failure and says
which. Without a GPU (nvidia-smi lists none) or without onnxruntime's CUDA provider it fails at once
and says so: the figures it would write are the GPU's own, never the CPU's. `--dry-run` runs the same
steps on the CPU at toy sizes (the existing export, the CPU provider, one short workload) to check the
plumbing where no GPU is at hand. Sized for under 10 minutes on one GPU (the export ~3-5 minutes).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
REAL_MODEL = REPO_ROOT / "models" / "smollm2-135m-instruct"
EXPORTED = REPO_ROOT / "model_repository" / "kvpop_engine" / "1"


@dataclass(frozen=True)
class Step:
    name: str
    command: list[str]
    timeout_s: int


def steps(out_dir: Path, dry_run: bool) -> list[Step]:
    """The check's steps: on the GPU, or (`dry_run`) the same on the CPU at toy sizes."""
    python = sys.executable
    export_dir = EXPORTED if dry_run else out_dir / "export-fp16"
    device = "cpu" if dry_run else "cuda"
    found = []
    if not dry_run:
        found.append(Step("export float16", [python, "-m", "export", "--model", str(REAL_MODEL), "--dtype", "float16",
                                             "--output", str(export_dir)], 420))
    found.append(Step(f"parity on the {device.upper()} provider",
                      [python, "-m", "kvpop_eval.bench.gpu_parity", "--model", str(REAL_MODEL), "--export", str(export_dir),
                       "--device", device, "--out", str(out_dir / "parity.json")], 180))
    split = ["--batches", "1", "--contexts", "1024", "--rounds", "1"] if dry_run else \
        ["--batches", "1", "8", "32", "--contexts", "1024", "2048", "4096", "--rounds", "5"]
    found.append(Step("decode step: weights / KV split", [python, "-m", "kvpop_eval.bench.step_split", "--model", str(export_dir),
                                                          "--device", device, "--out-dir", str(out_dir / "step-split"), *split], 300))
    service = ["--workloads", "chat", "--repetitions", "1", "--model-config", "cpu"] if dry_run else \
        ["--workloads", "prefill", "longgen", "memory", "chat", "--repetitions", "1", "--model-config", "single_gpu"]
    found.append(Step("SmolLM2 service benchmark", [python, "-m", "kvpop_eval.bench.real_service", "--model", str(export_dir),
                                                    "--hf-model", str(REAL_MODEL), "--systems", "full", "kvpop", "classic",
                                                    "--out-dir", str(out_dir / "service"), *service], 540))
    return found


def gpu_problem() -> str | None:
    """Why this machine cannot run the check on a GPU; None when it can."""
    from kvpop.serving.process.tritonserver import count_gpus

    if count_gpus() == 0:
        return "no GPU: nvidia-smi lists none. Run `make gpu-check` on a machine with an NVIDIA GPU (`--dry-run` checks the steps on the CPU)."
    import onnxruntime as ort

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        return ("onnxruntime has no CUDAExecutionProvider here: install onnxruntime-gpu (requirements/gpu.txt) in place of "
                "onnxruntime")
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvpop_eval.bench.gpu_check", description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=REPO_ROOT / "build" / "results" / "gpu-check")
    parser.add_argument("--plan", action="store_true", help="print the steps and run none")
    parser.add_argument("--dry-run", action="store_true", help="the same steps on the CPU at toy sizes (plumbing)")
    args = parser.parse_args(argv)
    plan = steps(args.out_dir, args.dry_run)
    if args.plan:
        for index, step in enumerate(plan, 1):
            print(f"{index}. {step.name} (at most {step.timeout_s} s): {' '.join(step.command)}")
        return 0
    problem = None if args.dry_run else gpu_problem()
    if problem:
        print(f"[gpu-check] FAILED before any step: {problem}", file=sys.stderr)
        return 2
    args.out_dir.mkdir(parents=True, exist_ok=True)
    record = {"dry_run": args.dry_run, "steps": []}
    for index, step in enumerate(plan, 1):
        log = args.out_dir / f"step{index}.log"
        print(f"[gpu-check] {index}/{len(plan)} {step.name} (log {log})", flush=True)
        started = time.time()
        with log.open("w") as handle:
            try:
                code = subprocess.run(step.command, cwd=REPO_ROOT, stdout=handle, stderr=subprocess.STDOUT, timeout=step.timeout_s).returncode
            except subprocess.TimeoutExpired:
                code = "timeout"
        record["steps"].append({"name": step.name, "command": step.command, "seconds": time.time() - started, "exit": code})
        (args.out_dir / "gpu_check.json").write_text(json.dumps(record, indent=2) + "\n")
        if code != 0:
            print(f"[gpu-check] FAILED at step {index} ({step.name}): exit {code}; the last lines of {log}:\n"
                  + "\n".join(log.read_text().splitlines()[-15:]), file=sys.stderr)
            return 1
    print(f"[gpu-check] every step passed: {args.out_dir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
