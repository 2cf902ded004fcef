"""Session 19: what line pooling costs the engine (wall time of the same requests, pooled and not).

    python docs/quality/real/experiments/spans/pooling_cost.py --tasks build/real-tasks/val-2048-pk24.jsonl \
        --num 8 --compression 0.88 --max-tokens 64 --repeats 2 --out docs/quality/real/experiments/spans/pooling-cost.json

Runs `num` task prompts together through one engine (in-flight batching, the vectorised decode batch) with
kvpop:mlstm, alternately with the shipped line pooling and with it switched off (each token ranked by its own
score), `repeats` times each, and prints the median wall time of each and their ratio. On a noisy machine
only the ratio means something.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[5]))

from kvpop.engine import CacheConfig, Engine, GenerationRequest, SamplingParams  # noqa: E402
from kvpop.eval import encode  # noqa: E402
from kvpop.scorer.runtime import LearnedScorer  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path, default=Path("model_repository/kvpop_engine/1"))
    parser.add_argument("--tasks", type=Path, required=True)
    parser.add_argument("--num", type=int, default=8)
    parser.add_argument("--compression", type=float, default=0.88)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    engine = Engine.from_model_dir(args.model)
    tasks = [json.loads(line) for line in args.tasks.read_text().splitlines()][: args.num]
    prompts = [encode(engine.tokenizer, task["prompt"]) for task in tasks]
    config = CacheConfig(policy="kvpop", compression=args.compression, scorer="mlstm")
    pooled_property = LearnedScorer.span_pooling
    seconds: dict[str, list[float]] = {"line pooling": [], "own score": []}
    for repeat in range(args.repeats):
        for name in seconds:
            LearnedScorer.span_pooling = pooled_property if name == "line pooling" else property(lambda self: "")
            requests = [GenerationRequest(f"{name}-{repeat}-{i}", prompt, SamplingParams(max_tokens=args.max_tokens, ignore_eos=True), config)
                        for i, prompt in enumerate(prompts)]
            start = time.perf_counter()
            engine.generate(requests)
            seconds[name].append(time.perf_counter() - start)
            print(f"[{repeat + 1}/{args.repeats}] {name}: {seconds[name][-1]:.1f} s", flush=True)
    LearnedScorer.span_pooling = pooled_property
    medians = {name: statistics.median(values) for name, values in seconds.items()}
    ratio = medians["line pooling"] / medians["own score"]
    print(f"median: line pooling {medians['line pooling']:.1f} s, own score {medians['own score']:.1f} s, ratio {ratio:.3f}")
    if args.out:
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "seconds": seconds,
                                        "median_s": medians, "ratio_pooled_to_own": round(ratio, 3)}, indent=1) + "\n")


if __name__ == "__main__":
    main()
