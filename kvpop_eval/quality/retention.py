"""Answer retention: does the answer survive the prompt's eviction? Each policy x compression, no generation.

Accuracy mixes two things: whether the policy kept the tokens the answer needs, and whether a small model,
reading a shorter context, still says it. Retention measures the first alone, and needs no sampling:
each task's prompt is prefilled once under the cache (`Engine.prefill`: the service's path, whole-prompt
eviction and the question's picks included) and the cache is read back. A task's answer is retained when,
for every item of it (a list answer has several), some occurrence of it in the prompt has every one of its
tokens held by every cache (each layer and KV head). A policy that keeps the answer and still loses
accuracy against the full cache loses it in the model, not in the eviction (docs/QUALITY.md).

    python -m kvpop_eval.quality.retention --model DIR --tasks FILE.jsonl --policies kvpop:mlstm,streaming \\
        --compressions 0.75,0.88,0.94 --out-dir DIR

writes retention.json, retention.md and retention_vs_compression.png.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from kvpop.engine import Engine
from kvpop.policies import POLICIES
from kvpop.request import CacheConfig, GenerationRequest, SamplingParams
from kvpop_eval.provenance import stamp
from kvpop_eval.quality.harness import policy_config
from kvpop_eval.quality.report import wilson_interval
from kvpop_eval.quality.tasks_io import encode, load_tasks


@dataclass(frozen=True)
class TaskRetention:
    found: bool  # every answer item occurs in the prompt (else the task says nothing about eviction)
    retained: bool  # every item has an occurrence whose tokens every cache holds
    token_share: float  # over items, the best occurrence's share of (cache, token) pairs held; 1.0 when retained


def answer_occurrences(tokenizer, prompt: str, prompt_ids: list[int], answer: object) -> list[list[np.ndarray]]:
    """For each answer item (a list answer has several), the prompt positions of each of its occurrences:
    the tokens whose characters overlap it (`prompt_ids` as `encode` made them: a BOS it added shifts by one)."""
    encoded = tokenizer(prompt, return_offsets_mapping=True)
    if "offset_mapping" not in encoded:
        raise ValueError("answer retention needs a fast tokenizer (character offsets)")
    offsets = np.asarray(encoded["offset_mapping"], np.int64).reshape(-1, 2)  # (P', 2) character span of each token
    shift = len(prompt_ids) - len(offsets)  # 1 when encode put a BOS in front
    items = answer if isinstance(answer, list) else [answer]
    occurrences = []
    for item in items:
        text, found, start = str(item).strip(), [], 0
        while text and (start := prompt.find(text, start)) >= 0:
            overlap = np.flatnonzero((offsets[:, 0] < start + len(text)) & (offsets[:, 1] > start))
            found.append(overlap + shift)
            start += 1
        occurrences.append(found)
    return occurrences


def task_retention(cache_positions: np.ndarray, occurrences: list[list[np.ndarray]]) -> TaskRetention:
    """`cache_positions` (L, Hkv, C): each slot's position, -1 empty (`SlotCache.position` after the prefill)."""
    if not occurrences or any(not found for found in occurrences):
        return TaskRetention(found=False, retained=False, token_share=0.0)
    length = int(max(cache_positions.max(), max(int(positions.max()) for found in occurrences for positions in found))) + 1
    held = np.zeros(cache_positions.shape[:2] + (length,), bool)  # (L, Hkv, N): whether each cache holds each position
    layer, head, slot = np.nonzero(cache_positions >= 0)
    held[layer, head, cache_positions[layer, head, slot]] = True
    shares = [max(float(held[:, :, positions].mean()) for positions in found) for found in occurrences]
    retained = all(any(bool(held[:, :, positions].all()) for positions in found) for found in occurrences)
    return TaskRetention(found=True, retained=retained, token_share=min(shares))


def measure(engine: Engine, prompts: list[tuple[list[int], list[list[np.ndarray]]]], cache: CacheConfig, max_tokens: int,
            label: str) -> dict:
    """Prefill every prompt (its ids, and its answer's occurrences: `answer_occurrences`) under `cache` and read
    back what the eviction kept: one summary row. `max_tokens` sizes the budget as in the accuracy runs (a
    compression is of the prompt plus the answer's tokens)."""
    results = []
    for index, (prompt_ids, occurrences) in enumerate(tqdm(prompts, desc=label, unit="task", file=sys.stderr, dynamic_ncols=True, leave=False)):
        request_id = f"retention-{index}"
        state = engine.prefill(GenerationRequest(request_id, prompt_ids, SamplingParams(max_tokens=max_tokens), cache))
        try:
            positions = np.array(state.cache.position)
        finally:
            engine.free(request_id)
        results.append(task_retention(positions, occurrences))
    found = [result for result in results if result.found]
    retained = sum(result.retained for result in found)
    low, high = wilson_interval(retained, len(found)) if found else (0.0, 0.0)
    return {
        "found": len(found),
        "retained": retained,
        "retention": retained / len(found) if found else 0.0,
        "interval": [low, high],
        "mean_token_share": float(np.mean([result.token_share for result in found])) if found else 0.0,
        "retained_by_task": "".join("-" if not result.found else "1" if result.retained else "0" for result in results),
        "tasks": [asdict(result) for result in results],
    }


def markdown(rows: list[dict], compressions: tuple[float, ...]) -> str:
    """Policy x compression: tasks whose answer every cache kept, of those whose answer is in the prompt."""
    lines = ["| policy | " + " | ".join(f"{ratio:.0%}" for ratio in compressions) + " |",
             "|---|" + "---|" * len(compressions)]
    for policy in dict.fromkeys(row["policy"] for row in rows):
        cells = {row["compression"]: row for row in rows if row["policy"] == policy}
        lines.append(f"| {policy} | " + " | ".join(
            f"{cells[ratio]['retained']}/{cells[ratio]['found']} ({cells[ratio]['retention']:.2f})" if ratio in cells else "-"
            for ratio in compressions) + " |")
    return "\n".join(lines) + "\n\nA cell: tasks whose answer every cache (layer, KV head) still holds after the prompt's eviction, " \
        "of the tasks whose answer occurs in the prompt (retention).\n"


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(8, 4))
    for policy in dict.fromkeys(row["policy"] for row in rows):
        mine = [row for row in rows if row["policy"] == policy]
        axes.plot([100 * row["compression"] for row in mine], [row["retention"] for row in mine], marker="o", label=policy)
    axes.set(xlabel="compression (%)", ylabel="answer retained", title="Answer retention vs KV compression", ylim=(-0.02, 1.02))
    axes.legend(fontsize="small", loc="center left", bbox_to_anchor=(1, 0.5))
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    from kvpop_eval.engine_factory import build_engine

    parser = argparse.ArgumentParser(prog="python -m kvpop_eval.quality.retention", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True, help="exported model directory (decoder_step.onnx)")
    parser.add_argument("--tasks", type=Path, required=True, help="JSONL with 'prompt' and 'answer' per line")
    parser.add_argument("--policies", required=True, help="comma-separated sweep names: streaming, kvpop:mlstm, kvpop:mlstm+noquery, ...")
    parser.add_argument("--compressions", default="0.75,0.88,0.94")
    parser.add_argument("--max-tokens", type=int, default=32, help="the answer length the budget is sized for, as in the accuracy runs")
    parser.add_argument("--sinks", type=int, default=4)
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--limit", type=int, default=None, help="first N tasks only")
    parser.add_argument("--prefill-chunk", type=int, default=256)
    parser.add_argument("--whole-prompt-tokens", type=int, default=8192, help="as kvpop_eval.quality")
    parser.add_argument("--out-dir", type=Path, required=True)
    args = parser.parse_args(argv)

    policies = [name.strip() for name in args.policies.split(",") if name.strip()]
    unknown = [name for name in policies if name.partition(":")[0] not in POLICIES or name == "full"]
    if unknown:
        parser.error(f"unknown or non-evicting policies {unknown}; registered: {', '.join(POLICIES)}")
    compressions = tuple(float(ratio) for ratio in args.compressions.split(","))
    tasks = load_tasks(args.tasks, args.limit)
    engine = build_engine(args.model, max_batch_size=1, prefill_chunk=args.prefill_chunk, whole_prompt_tokens=args.whole_prompt_tokens)
    prompts = []  # tokenized once, for every policy x compression
    for task in tasks:
        prompt_ids = encode(engine.tokenizer, task["prompt"])
        prompts.append((prompt_ids, answer_occurrences(engine.tokenizer, task["prompt"], prompt_ids, task["answer"])))
    rows = []
    for policy in policies:
        for ratio in compressions:
            config = policy_config(policy, ratio, args.sinks, args.window)
            row = {"policy": policy, "compression": ratio, **measure(engine, prompts, config, args.max_tokens, f"{policy} @ {ratio:.0%}")}
            rows.append(row)
            print(f"{policy} @ {ratio:.0%}: answer retained in {row['retained']}/{row['found']} tasks "
                  f"({row['retention']:.2f}, 95% CI {row['interval'][0]:.2f}-{row['interval'][1]:.2f})", flush=True)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    header = stamp({"tasks": len(tasks), "tasks_file": str(args.tasks),
                    "tasks_sha256": hashlib.sha256(args.tasks.read_bytes()).hexdigest(), "max_tokens": args.max_tokens})
    (args.out_dir / "retention.json").write_text(json.dumps({**header, "results": rows}, indent=2) + "\n")
    (args.out_dir / "retention.md").write_text(markdown(rows, compressions))
    plot(rows, args.out_dir / "retention_vs_compression.png")
    print(f"wrote {args.out_dir}/retention.json, retention.md, retention_vs_compression.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
