"""Quality harness: accuracy of the engine on a JSONL of {"prompt", "answer"} under one policy/budget,
or a sweep of every policy over compression ratios (JSON + markdown table + accuracy plot).

    python -m kvpop.eval --model DIR --tasks FILE.jsonl --policy P (--budget N | --compression R) --out report.json
    python -m kvpop.eval --model DIR --tasks FILE.jsonl --sweep --out-dir DIR [--compressions 0,0.5,0.75,0.88,0.94]

A sweep entry is a policy name, or `kvpop:<scorer>` for the kvpop policy with one scorer; by default the
sweep runs every policy (kvpop with its attention-based scorer) plus `kvpop:<kind>` for every learned
scorer exported with the model (stateful `mlstm`, stateless `mlp`), so they are compared side by side.

Scoring: `final_answer` (default) is the project tasks' exact match of the word after "#";
`contains` counts an answer found anywhere in the generated text (for arbitrary JSONL; a list answer
needs all of its items).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import time
from pathlib import Path
from typing import Callable

from kvpop.engine import Engine, EngineConfig
from kvpop.request import CacheConfig, GenerationRequest, SamplingParams
from kvpop.policies import POLICIES

SWEEP_COMPRESSIONS = (0.0, 0.5, 0.75, 0.88, 0.94)


def load_tasks(path: Path, limit: int | None = None) -> list[dict]:
    tasks = []
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        record = json.loads(line)
        if "prompt" not in record or "answer" not in record:
            raise ValueError(f"{path}:{number}: every line needs 'prompt' and 'answer' fields")
        tasks.append(record)
    if not tasks:
        raise ValueError(f"{path}: no tasks")
    return tasks[:limit] if limit else tasks


def scorer(name: str) -> Callable[[str, str], bool]:
    if name == "contains":  # a list answer (several values asked for) needs every one of them
        return lambda generated, answer: all(
            str(item).strip() in generated for item in (answer if isinstance(answer, list) else [answer])
        )
    from kvpop.tasks import exact_match

    return lambda generated, answer: exact_match(generated, str(answer))


def encode(tokenizer, prompt: str) -> list[int]:
    ids = list(tokenizer(prompt)["input_ids"])
    bos = getattr(tokenizer, "bos_token_id", None)
    return ids if bos is None or (ids and ids[0] == bos) else [bos, *ids]


def evaluate(
    engine: Engine, tasks: list[dict], cache: CacheConfig, max_tokens: int, scoring: str = "final_answer"
) -> dict:
    """Run every task greedily under `cache`; return the report (summary + one row per task)."""
    tokenizer, is_correct = engine.tokenizer, scorer(scoring)
    requests = [
        GenerationRequest(f"task-{index}", encode(tokenizer, task["prompt"]), SamplingParams(max_tokens=max_tokens), cache)
        for index, task in enumerate(tasks)
    ]
    start = time.perf_counter()
    results = engine.generate(requests)
    seconds = time.perf_counter() - start
    rows = []
    for task, result in zip(tasks, results):
        text = tokenizer.decode(result.output_ids, skip_special_tokens=True)
        rows.append({
            "index": task.get("index", len(rows)),
            "answer": str(task["answer"]),
            "generated": text,
            "correct": bool(is_correct(text, task["answer"])),
            "prompt_tokens": len(result.prompt_ids),
            "output_tokens": len(result.output_ids),
            "budget": result.budget,
            "compression": result.compression,
            "peak_kv_bytes": result.peak_kv_bytes,
        })
    count = len(rows)
    policy = cache.build_policy(engine.learned_scorers)
    return {
        "policy": cache.policy,
        "budget": cache.budget,
        "compression_target": cache.compression,
        "sinks": cache.sinks,
        "window": cache.window,
        "scoring": scoring,
        "tasks": count,
        "accuracy": sum(row["correct"] for row in rows) / count,
        "compression_achieved": sum(row["compression"] for row in rows) / count,
        "mean_budget": sum(row["budget"] for row in rows) / count,
        "max_peak_kv_bytes": max(row["peak_kv_bytes"] for row in rows),
        # prompts prefilled whole, then evicted (Engine whole_prompt_tokens): they held all their keys meanwhile
        "prefilled_whole": sum(engine.scheduler.prefills_whole(policy, row["budget"] if policy.evicts else None, row["prompt_tokens"])
                               for row in rows),
        "generated_tokens_per_s": sum(row["output_tokens"] for row in rows) / seconds,
        "seconds": seconds,
        "rows": rows,
    }


def sweep(
    engine: Engine,
    tasks: list[dict],
    out_dir: Path,
    policies: list[str],
    compressions: tuple[float, ...],
    max_tokens: int,
    scoring: str,
    sinks: int,
    window: int,
    tasks_file: Path | None = None,
    run_full: bool = True,
) -> list[dict]:
    """Every policy x compression. At 0% nothing is evicted, so every policy IS the full cache:
    full runs once and stands for all of them there. Without `run_full` (rows to merge into a sweep
    that has the full cache, `--merge`) only the listed policies run and only sweep.json is written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    header = {"tasks": len(tasks), "scoring": scoring, "tasks_file": str(tasks_file) if tasks_file else None,
              "tasks_sha256": hashlib.sha256(Path(tasks_file).read_bytes()).hexdigest() if tasks_file else None}

    def save(complete: bool) -> None:  # after every run: a long sweep cut short keeps what it measured
        (out_dir / "sweep.json").write_text(json.dumps({**header, "complete": complete, "results": summary}, indent=2) + "\n")
        if run_full:
            (out_dir / "sweep.md").write_text(markdown_table(summary, compressions))

    summary: list[dict] = []
    if run_full:
        full = evaluate(engine, tasks, CacheConfig(policy="full", sinks=sinks, window=window), max_tokens, scoring)
        summary.append(_summary_row(full, "full", 0.0))
        save(False)
        print(f"full: accuracy {full['accuracy']:.3f} ({full['seconds']:.0f} s)", flush=True)
    for policy in policies:
        if policy == "full":
            continue
        for ratio in compressions:
            if ratio == 0.0:
                if run_full:
                    summary.append({**_summary_row(full, policy, 0.0), "note": "no eviction at 0%: the full cache"})
                continue
            name, _, scorer_name = policy.partition(":")
            config = CacheConfig(policy=name, compression=ratio, sinks=sinks, window=window,
                                 scorer=scorer_name or "accumulated_attention")
            report = evaluate(engine, tasks, config, max_tokens, scoring)
            summary.append(_summary_row(report, policy, ratio))
            save(False)
            print(f"{policy} @ {ratio:.0%}: accuracy {report['accuracy']:.3f} ({report['seconds']:.0f} s)", flush=True)
    save(True)
    if run_full:
        plot_sweep(summary, out_dir / "accuracy_vs_compression.png")
    return summary


def merge_sweeps(sweep_dirs: list[Path], out_dir: Path) -> list[dict]:
    """One sweep from several run on the SAME tasks (say, the heuristics first and the learned scorers
    once trained): the first sweep's full-cache row, every other policy's rows in the given order
    (a later sweep's row replaces an earlier one), runtimes summed into the header."""
    sweeps = [json.loads((Path(folder) / "sweep.json").read_text()) for folder in sweep_dirs]
    digests = {sweep["tasks_sha256"] for sweep in sweeps}
    if len(digests) != 1 or None in digests:
        raise ValueError(f"sweeps of different (or unnamed) task files cannot be merged: {sorted(map(str, digests))}")
    rows: dict[tuple[str, float], dict] = {}
    for index, sweep in enumerate(sweeps):
        for row in sweep["results"]:
            if row["policy"] == "full" and index:
                continue
            rows[(row["policy"], row["compression"])] = row
    full = rows[("full", 0.0)]
    for policy in dict.fromkeys(policy for policy, _ in rows):  # a --skip-full sweep's rows have no 0% cell
        if (policy, 0.0) not in rows:
            rows[(policy, 0.0)] = {**full, "policy": policy, "note": "no eviction at 0%: the full cache"}
    order = list(dict.fromkeys(policy for policy, _ in rows))
    summary = sorted(rows.values(), key=lambda row: (order.index(row["policy"]), row["compression"]))
    compressions = tuple(sorted({row["compression"] for row in summary}))
    header = {key: sweeps[0][key] for key in ("tasks", "scoring", "tasks_file", "tasks_sha256")}
    header["merged_from"] = [str(folder) for folder in sweep_dirs]
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "sweep.json").write_text(json.dumps({**header, "results": summary}, indent=2) + "\n")
    (out_dir / "sweep.md").write_text(markdown_table(summary, compressions))
    plot_sweep(summary, out_dir / "accuracy_vs_compression.png")
    return summary


def _summary_row(report: dict, policy: str, ratio: float) -> dict:
    keys = ("accuracy", "compression_achieved", "mean_budget", "max_peak_kv_bytes", "generated_tokens_per_s", "tasks", "seconds",
            "prefilled_whole")
    # One character per task, in task order, so any two rows can be compared task by task.
    correct = "".join("1" if row["correct"] else "0" for row in report["rows"])
    return {"policy": policy, "compression": ratio, **{key: report[key] for key in keys}, "correct_by_task": correct}


def wilson_interval(successes: int, count: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a binomial proportion (sound near 0 and 1, unlike the normal one)."""
    if count == 0:
        return 0.0, 1.0
    p = successes / count
    center = (p + z * z / (2 * count)) / (1 + z * z / count)
    half = z * math.sqrt(p * (1 - p) / count + z * z / (4 * count * count)) / (1 + z * z / count)
    return max(0.0, center - half), min(1.0, center + half)


def paired_counts(correct: str, reference: str) -> tuple[int, int]:
    """(tasks right here and wrong in `reference`, tasks wrong here and right in `reference`)."""
    if len(correct) != len(reference):
        raise ValueError(f"rows cover {len(correct)} and {len(reference)} tasks")
    wins = sum(a == "1" and b == "0" for a, b in zip(correct, reference))
    losses = sum(a == "0" and b == "1" for a, b in zip(correct, reference))
    return wins, losses


def markdown_table(summary: list[dict], compressions: tuple[float, ...]) -> str:
    accuracy = {(row["policy"], row["compression"]): row["accuracy"] for row in summary}
    full = accuracy[("full", 0.0)]
    lines = [
        "| policy | " + " | ".join(f"{ratio:.0%}" for ratio in compressions) + " |",
        "|---|" + "---|" * len(compressions),
        "| full | " + " | ".join(f"{full:.3f}" if ratio == 0.0 else "-" for ratio in compressions) + " |",
    ]
    for policy in dict.fromkeys(row["policy"] for row in summary if row["policy"] != "full"):
        cells = [f"{accuracy[(policy, ratio)]:.3f}" if (policy, ratio) in accuracy else "-" for ratio in compressions]
        lines.append(f"| {policy} | " + " | ".join(cells) + " |")
    text = "Accuracy by eviction policy and compression (1 - budget / tokens).\n\n" + "\n".join(lines) + "\n"
    if 0.0 in compressions:
        text += ("\nAt 0% nothing is evicted, so no row is run there: each 0% cell is the full cache's accuracy, "
                 "copied (the engine's for engine policies; for `kvpress:` rows, the Hugging Face full cache's).\n")
    return text + _interval_table(summary, compressions) + _runtime_table(summary, compressions)


def _runtime_table(summary: list[dict], compressions: tuple[float, ...]) -> str:
    """Wall seconds of each run (all its tasks, batched), where the row recorded them."""
    timed = [row for row in summary if "seconds" in row and not row.get("note")]
    if not timed:
        return ""
    seconds = {(row["policy"], row["compression"]): row["seconds"] for row in timed}
    lines = [
        "\nWall seconds per run (every task of the row, batched, on the machine named in the report):\n",
        "| policy | " + " | ".join(f"{ratio:.0%}" for ratio in compressions) + " |",
        "|---|" + "---|" * len(compressions),
    ]
    for policy in dict.fromkeys(row["policy"] for row in timed):
        cells = [f"{seconds[(policy, ratio)]:.0f}" if (policy, ratio) in seconds else "-" for ratio in compressions]
        lines.append(f"| {policy} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _interval_table(summary: list[dict], compressions: tuple[float, ...]) -> str:
    """Each accuracy with its 95% Wilson interval and, where the row kept per-task results, its paired
    count against the engine's full cache (+ tasks only it solves / - tasks only the full cache solves)."""
    rows = {(row["policy"], row["compression"]): row for row in summary}
    full = rows[("full", 0.0)]
    lines = [
        "\n95% Wilson interval of each accuracy, and paired counts against the engine's full cache "
        "(+wins / -losses: tasks only this row / only the full cache gets right):\n",
        "| policy | " + " | ".join(f"{ratio:.0%}" for ratio in compressions) + " |",
        "|---|" + "---|" * len(compressions),
    ]
    for policy in dict.fromkeys(row["policy"] for row in summary):
        cells = []
        for ratio in compressions:
            row = rows.get((policy, ratio))
            if row is None:
                cells.append("-")
                continue
            low, high = wilson_interval(round(row["accuracy"] * row["tasks"]), row["tasks"])
            cell = f"{row['accuracy']:.3f} [{low:.2f}, {high:.2f}]"
            if ratio and "correct_by_task" in row and "correct_by_task" in full:
                wins, losses = paired_counts(row["correct_by_task"], full["correct_by_task"])
                cell += f" +{wins}/-{losses}"
            cells.append(cell)
        lines.append(f"| {policy} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot_sweep(summary: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(8, 4))
    for policy in dict.fromkeys(row["policy"] for row in summary if row["policy"] != "full"):
        rows = [row for row in summary if row["policy"] == policy]
        style = ":" if policy.startswith("kvpress:") else "-"  # the outside peer, merged in by kvpress_compare
        axes.plot([100 * row["compression"] for row in rows], [row["accuracy"] for row in rows], marker="o",
                  linestyle=style, label=policy)
    full = next(row["accuracy"] for row in summary if row["policy"] == "full")
    axes.axhline(full, color="black", linestyle="--", label="full cache")
    axes.set(xlabel="compression (%)", ylabel="accuracy", title="Accuracy vs KV compression", ylim=(-0.02, 1.02))
    axes.legend(fontsize="small", loc="center left", bbox_to_anchor=(1, 0.5))
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvpop.eval", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="exported model directory (decoder_step.onnx); required unless --merge")
    parser.add_argument("--tasks", type=Path, help="JSONL with 'prompt' and 'answer' per line; required unless --merge")
    parser.add_argument("--policy", choices=list(POLICIES), default="full")
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--budget", type=int, help="slots per head")
    size.add_argument("--compression", type=float, help="0 <= r < 1")
    parser.add_argument("--sinks", type=int, default=4)
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--limit", type=int, default=None, help="first N tasks only")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--prefill-chunk", type=int, default=256)
    parser.add_argument("--whole-prompt-tokens", type=int, default=8192,
                        help="a bounded cache whose policy reads no attention prefills prompts up to this long whole, "
                             "then evicts (the service's whole_prompt_tokens); 0: evict while prefilling")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--scoring", choices=["final_answer", "contains"], default="final_answer")
    parser.add_argument("--out", type=Path, help="report JSON (single run)")
    parser.add_argument("--sweep", action="store_true", help="every policy x --compressions")
    parser.add_argument("--out-dir", type=Path, help="sweep output folder")
    parser.add_argument("--policies", help="sweep: comma-separated policies or kvpop:<scorer> (default: all)")
    parser.add_argument("--scorer", default="accumulated_attention", help="single run, kvpop policy: its scorer")
    parser.add_argument("--compressions", default=",".join(str(r) for r in SWEEP_COMPRESSIONS))
    parser.add_argument("--skip-full", action="store_true", help="sweep: do not run the full cache (rows for --merge)")
    parser.add_argument("--merge", type=Path, nargs="+", help="merge these sweep folders (same tasks) into --out-dir; runs nothing")
    args = parser.parse_args(argv)

    if args.merge:
        if args.out_dir is None:
            parser.error("--merge needs --out-dir")
        merge_sweeps(args.merge, args.out_dir)
        print(f"merged {len(args.merge)} sweeps into {args.out_dir}")
        return 0
    if args.model is None or args.tasks is None:
        parser.error("--model and --tasks are required (except with --merge)")

    tasks = load_tasks(args.tasks, args.limit)
    engine = Engine.from_model_dir(args.model, EngineConfig(max_batch_size=args.batch_size, prefill_chunk=args.prefill_chunk, whole_prompt_tokens=args.whole_prompt_tokens), device=args.device)
    if args.sweep:
        if args.out_dir is None:
            parser.error("--sweep needs --out-dir")
        default = [*POLICIES, *(f"kvpop:{kind}" for kind in engine.learned_scorers)]
        policies = [name.strip() for name in args.policies.split(",") if name.strip()] if args.policies else default
        unknown = [name for name in policies if name.partition(":")[0] not in POLICIES]
        if unknown:
            parser.error(f"unknown policies {unknown}; registered: {', '.join(POLICIES)}")
        compressions = tuple(float(ratio) for ratio in args.compressions.split(","))
        sweep(engine, tasks, args.out_dir, policies, compressions, args.max_tokens, args.scoring, args.sinks, args.window,
              tasks_file=args.tasks if not args.limit else None, run_full=not args.skip_full)
        print(f"wrote {args.out_dir}/sweep.json, sweep.md, accuracy_vs_compression.png")
        return 0
    if args.out is None:
        parser.error("a single run needs --out")
    try:
        config = CacheConfig(policy=args.policy, budget=args.budget, compression=args.compression, sinks=args.sinks,
                             window=args.window, scorer=args.scorer)
    except ValueError as error:
        parser.error(str(error))
    report = evaluate(engine, tasks, config, args.max_tokens, args.scoring)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"{args.policy}: accuracy {report['accuracy']:.3f} on {report['tasks']} tasks, "
          f"compression {report['compression_achieved']:.1%} -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
