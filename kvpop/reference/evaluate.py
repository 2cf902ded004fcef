"""Measure the reference model: greedy exact match with the full cache and with StreamingLLM.

    python -m kvpop.reference.evaluate [--model models/reference] [--lengths 512 1024 2048]
        [--num 200] [--keep-fraction 0.12] [--tasks FILE.jsonl]

For every context length it generates the test split (or reads --tasks, any JSONL with
`prompt` and `answer`), decodes greedily with each cache policy, and prints and saves the
accuracies as JSON and a plot under --out. StreamingLLM gets a budget of keep_fraction of the
tokens the full cache ends with (prompt plus reference reasoning), sinks included.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AutoTokenizer, LlamaForCausalLM

from kvpop.reference.checkpoint import SUMMARY_FILE
from kvpop.reference.decoding import StreamingLLM, greedy_generate
from kvpop.reference.model_card import render_card
from kvpop.tasks import TaskConfig, exact_match, generate_task
from kvpop.tasks.language import FINAL


def load_records(args: argparse.Namespace) -> dict[str, list[dict]]:
    """Task records grouped by a label (context length, or the file name)."""
    if args.tasks is not None:
        lines = args.tasks.read_text().splitlines()
        return {args.tasks.stem: [json.loads(line) for line in lines[: args.num] if line.strip()]}
    return {
        str(length): [generate_task(TaskConfig(context_tokens=length, hops=args.hops), "test", i).to_json() for i in range(args.num)]
        for length in args.lengths
    }


def evaluate_records(model: LlamaForCausalLM, tokenizer, records: list[dict], args: argparse.Namespace, label: str) -> dict:
    stop_ids = {tokenizer.eos_token_id}
    final_id = tokenizer.convert_tokens_to_ids(FINAL)
    correct = {"full": 0, "streaming": 0}
    budgets: list[int] = []
    samples: list[dict] = []
    for record in tqdm(records, desc=f"context {label}", mininterval=10):
        prompt_ids = tokenizer(record["prompt"])["input_ids"]
        reasoning_tokens = record.get("target_tokens", 0)
        budget = math.ceil(args.keep_fraction * (len(prompt_ids) + reasoning_tokens))
        budgets.append(budget)
        policies = {"full": None, "streaming": StreamingLLM(budget=budget, sink_tokens=args.sink_tokens)}
        outputs = {}
        for name, policy in policies.items():
            ids = greedy_generate(model, prompt_ids, args.max_new_tokens, stop_ids, final_id, policy)
            outputs[name] = tokenizer.decode(ids, skip_special_tokens=True)
            correct[name] += exact_match(outputs[name], record["answer"])
        if len(samples) < 3:
            samples.append({"answer": record["answer"], **outputs})
    tasks = len(records)
    return {
        "context_tokens": int(label) if label.isdigit() else label,
        "tasks": tasks,
        "full": correct["full"] / tasks,
        "streaming": correct["streaming"] / tasks,
        "streaming_budget_mean": sum(budgets) / tasks,
        "samples": samples,
    }


def plot(results: list[dict], path: Path, keep_fraction: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [str(row["context_tokens"]) for row in results]
    figure, axis = plt.subplots(figsize=(6, 4))
    axis.plot(labels, [row["full"] for row in results], marker="o", label="full cache")
    axis.plot(labels, [row["streaming"] for row in results], marker="s", label=f"StreamingLLM ({keep_fraction:.0%} kept)")
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
    parser = argparse.ArgumentParser(prog="python -m kvpop.reference.evaluate", description=__doc__)
    parser.add_argument("--model", type=Path, default=Path("models/reference"))
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048])
    parser.add_argument("--num", type=int, default=200, help="tasks per length")
    parser.add_argument("--hops", type=int, default=3)
    parser.add_argument("--tasks", type=Path, default=None, help="evaluate this JSONL instead of generated tasks")
    parser.add_argument("--keep-fraction", type=float, default=0.12, help="StreamingLLM budget (0.12 = 88%% compression)")
    parser.add_argument("--sink-tokens", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--out", type=Path, default=Path("docs/reference_model"))
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = LlamaForCausalLM.from_pretrained(args.model).eval()
    start = time.monotonic()
    results = [evaluate_records(model, tokenizer, records, args, label) for label, records in load_records(args).items()]
    summary_path = args.model / SUMMARY_FILE
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else None
    evaluation = {
        "model": str(args.model),
        "trained_step": summary["step"] if summary else None,
        "keep_fraction": args.keep_fraction,
        "sink_tokens": args.sink_tokens,
        "hops": args.hops,
        "seconds": round(time.monotonic() - start, 1),
        "results": results,
    }
    for row in results:
        print(f"context {row['context_tokens']}: full {row['full']:.3f}  streaming {row['streaming']:.3f}  ({row['tasks']} tasks)")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "eval.json").write_text(json.dumps(evaluation, indent=2) + "\n")
    plot(results, args.out / "accuracy.png", args.keep_fraction)
    if args.tasks is None and summary is not None:
        (args.model / "MODEL_CARD.md").write_text(render_card(summary, evaluation))
    print(f"saved {args.out / 'eval.json'} and {args.out / 'accuracy.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
