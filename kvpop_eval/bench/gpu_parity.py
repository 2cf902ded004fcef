"""Parity of an export on a chosen onnxruntime provider against the Hugging Face model (export.parity's
check, there on the CPU provider at export time): a float16 export on the CUDA provider is what a GPU
instance runs, and its numbers are the GPU kernels', not the CPU's.

    python -m kvpop_eval.bench.gpu_parity --model models/smollm2-135m-instruct --export DIR --device cuda --out parity.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvpop_eval.bench.gpu_parity", description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help="the Hugging Face model directory")
    parser.add_argument("--export", type=Path, required=True, help="its export (python -m export)")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    import torch
    from transformers import AutoModelForCausalLM

    from export.parity import PARITY_TOLERANCES, check_parity
    from kvpop.decoder import DecoderStep

    step = DecoderStep(args.export, device=args.device)
    providers = step.session.get_providers()
    if args.device == "cuda" and "CUDAExecutionProvider" not in providers:
        raise SystemExit(f"the step runs on {providers}, not on the CUDA provider")
    reference = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    report = check_parity(reference, step, tolerance=PARITY_TOLERANCES[step.spec.dtype])
    result = {"export": str(args.export), "dtype": step.spec.dtype, "providers": providers, **report.as_dict()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0 if report.passed else 1


if __name__ == "__main__":
    raise SystemExit(main())
