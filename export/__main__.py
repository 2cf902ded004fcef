"""`python -m export --model DIR`: write the ONNX decoder step, tokenizer and model spec into the
model repository, and fail unless the ONNX step matches the Hugging Face model. Nothing is redone when
the output is up to date with the model, the export code, the dtype and the scorers (`--force` redoes it).

Without --model: SmolLM2-135M-Instruct when `make model` has built it (models/smollm2-135m-instruct),
else the shipped reference model (models/reference), else a tiny random Llama (for plumbing only: its
text is meaningless). `make export` builds SmolLM2 first and names it explicitly.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUTPUT = REPO_ROOT / "model_repository" / "kvpop_engine" / "1"
REFERENCE_MODEL = REPO_ROOT / "models" / "reference"
REAL_MODEL = REPO_ROOT / "models" / "smollm2-135m-instruct"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m export", description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="local Hugging Face model directory (Llama, Qwen2, Mistral)")
    parser.add_argument("--tiny", action="store_true", help="export a tiny random Llama (tests, plumbing)")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="model version directory to write")
    parser.add_argument("--scorer-dir", type=Path, default=None,
                        help="trained KVpop scorers (default: MODEL/scorer, else scorers/<model directory name>/)")
    parser.add_argument("--scorers-only", action="store_true",
                        help="re-export only the scorers into an existing export of --model (after retraining them)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16"],
                        help="weights, KV cache and logits of the decoder step (float16: for GPU instances)")
    parser.add_argument("--force", action="store_true",
                        help="export again even when the output is up to date (same model files, code, dtype, scorers)")
    args = parser.parse_args(argv)

    from export.pipeline import ExportError, export_model, export_scorers_only

    if args.scorers_only:
        if args.model is None:
            parser.error("--scorers-only needs --model (the exported model)")
        try:
            report = export_scorers_only(args.model, args.output, args.scorer_dir)
        except ExportError as error:
            print(f"[export] FAILED: {error}", file=sys.stderr)
            return 1
        print(json.dumps(report["scorers"], indent=2))
        return 0

    with tempfile.TemporaryDirectory() as scratch:
        model_dir = args.model
        if model_dir is None:
            from export.real_model import is_complete

            if not args.tiny and is_complete(REAL_MODEL):
                model_dir = REAL_MODEL
            elif not args.tiny and (REFERENCE_MODEL / "config.json").exists():
                model_dir = REFERENCE_MODEL
            else:
                from export.tiny_model import build_tiny_llama

                print("[export] no --model given and no reference model: building a tiny random Llama", flush=True)
                model_dir = build_tiny_llama(Path(scratch) / "tiny-llama")
        try:
            report = export_model(model_dir, args.output, args.scorer_dir, dtype=args.dtype, force=args.force)
        except ExportError as error:
            print(f"[export] FAILED: {error}", file=sys.stderr)
            return 1
    print(json.dumps(report["parity"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
