"""Measure the reference model: greedy exact match with the full cache and with StreamingLLM.

    python -m kvpop_eval.reference_model [--model models/reference] [--lengths 512 1024 2048]
        [--num 200] [--compression 0.88] [--tasks FILE.jsonl] [--onnx EXPORTED_DIR]

The same harness as every other accuracy figure (`kvpop_eval.quality`): the model is exported to ONNX (or
--onnx names an export) and run by the engine, with the engine's StreamingLLM policy. For every
context length it generates the test split (or reads --tasks), and prints and saves the accuracies as
JSON and a plot under --out; the model card is rewritten with them. StreamingLLM's budget is the
engine's: ceil((1 - compression) x (prompt + max_tokens)) slots per head, sinks included.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from transformers import AutoTokenizer

from kvpop.decoder import DecoderStep
from kvpop.engine import Engine
from kvpop.request import CacheConfig
from kvpop_eval.quality import load_tasks
from kvpop_eval.quality.harness import evaluate
from kvpop_tasks import TaskConfig, generate_task
from kvpop_train.reference.checkpoint import SUMMARY_FILE
from kvpop_train.reference.model_card import render_card


def load_records(args: argparse.Namespace) -> dict[str, list[dict]]:
    """Task records grouped by a label (context length, or the file name)."""
    if args.tasks is not None:
        return {args.tasks.stem: load_tasks(args.tasks, args.num)}
    return {
        str(length): [generate_task(TaskConfig(context_tokens=length, hops=args.hops), "test", i).to_json() for i in range(args.num)]
        for length in args.lengths
    }


def evaluate_records(engine: Engine, records: list[dict], args: argparse.Namespace, label: str) -> dict:
    full = evaluate(engine, records, CacheConfig("full"), args.max_new_tokens)
    streaming = evaluate(
        engine, records, CacheConfig("streaming", compression=args.compression, options=dict(sinks=args.sink_tokens)), args.max_new_tokens
    )
    samples = [
        {"answer": full_row["answer"], "full": full_row["generated"], "streaming": streaming_row["generated"]}
        for full_row, streaming_row in list(zip(full["rows"], streaming["rows"]))[:3]
    ]
    return {
        "context_tokens": int(label) if label.isdigit() else label,
        "tasks": full["tasks"],
        "full": full["accuracy"],
        "streaming": streaming["accuracy"],
        "streaming_budget_mean": streaming["mean_budget"],
        "samples": samples,
    }


def plot(results: list[dict], path: Path, compression: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [str(row["context_tokens"]) for row in results]
    figure, axis = plt.subplots(figsize=(6, 4))
    axis.plot(labels, [row["full"] for row in results], marker="o", label="full cache")
    axis.plot(labels, [row["streaming"] for row in results], marker="s", label=f"StreamingLLM ({compression:.0%} compression)")
    axis.set_xlabel("context tokens")
    axis.set_ylabel("exact match (test split)")
    axis.set_ylim(0, 1.02)
    axis.grid(alpha=0.3)
    axis.legend()
    axis.set_title("KVpop reference model")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvpop_eval.reference_model", description=__doc__)
    parser.add_argument("--model", type=Path, default=Path("models/reference"))
    parser.add_argument("--onnx", type=Path, default=None, help="an export of --model (default: export it to a scratch folder)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048])
    parser.add_argument("--num", type=int, default=200, help="tasks per length")
    parser.add_argument("--hops", type=int, default=3)
    parser.add_argument("--tasks", type=Path, default=None, help="evaluate this JSONL instead of generated tasks")
    parser.add_argument("--compression", type=float, default=0.88, help="StreamingLLM's KV compression")
    parser.add_argument("--sink-tokens", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=None, help="onnxruntime threads (default: onnxruntime's)")
    parser.add_argument("--out", type=Path, default=Path("build/results/reference-model"))
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory() as scratch:
        onnx_dir = args.onnx
        if onnx_dir is None:
            from export.pipeline import export_model

            onnx_dir = Path(scratch) / "onnx"
            export_model(args.model, onnx_dir)
        engine = Engine(DecoderStep(onnx_dir, threads=args.threads), tokenizer=AutoTokenizer.from_pretrained(onnx_dir / "tokenizer"))
        start = time.monotonic()
        results = [evaluate_records(engine, records, args, label) for label, records in load_records(args).items()]
    summary_path = args.model / SUMMARY_FILE
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else None
    evaluation = {
        "model": str(args.model),
        "harness": "kvpop_eval.quality (ONNX export, engine policies full and streaming)",
        "trained_step": summary["step"] if summary else None,
        "compression": args.compression,
        "keep_fraction": 1 - args.compression,
        "sink_tokens": args.sink_tokens,
        "hops": args.hops,
        "seconds": round(time.monotonic() - start, 1),
        "results": results,
    }
    for row in results:
        print(f"context {row['context_tokens']}: full {row['full']:.3f}  streaming {row['streaming']:.3f}  ({row['tasks']} tasks)")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "eval.json").write_text(json.dumps(evaluation, indent=2) + "\n")
    plot(results, args.out / "accuracy.png", args.compression)
    if args.tasks is None and summary is not None:
        (args.model / "MODEL_CARD.md").write_text(render_card(summary, evaluation))
    print(f"saved {args.out / 'eval.json'} and {args.out / 'accuracy.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
