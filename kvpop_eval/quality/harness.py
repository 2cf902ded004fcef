"""The engine under one policy and budget on a task list, and every policy x compression (a sweep)."""

from __future__ import annotations

import hashlib
import json
import sys
import time
from pathlib import Path

from tqdm import tqdm

from kvpop.engine import Engine
from kvpop.policies.kvpop import query
from kvpop.request import CacheConfig, GenerationRequest, SamplingParams
from kvpop_eval.provenance import stamp
from kvpop_eval.quality.report import markdown_table, plot_sweep, summary_row
from kvpop_eval.quality.tasks_io import encode, scorer


def evaluate(
    engine: Engine, tasks: list[dict], cache: CacheConfig, max_tokens: int, scoring: str = "final_answer",
    label: str | None = None,
) -> dict:
    """Run every task greedily under `cache`; return the report (summary + one row per task). `label`: the
    progress bar's name (a sweep row's), else the policy's."""
    tokenizer, is_correct = engine.tokenizer, scorer(scoring)
    policy = cache.build_policy(engine.policy_assets)
    requests = [
        GenerationRequest(f"task-{index}", encode(tokenizer, task["prompt"]), SamplingParams(max_tokens=max_tokens), cache)
        for index, task in enumerate(tasks)
    ]
    label = label or (cache.policy if cache.policy != "kvpop" else f"kvpop:{cache.options.scorer}")
    label += f" @ {cache.compression:.0%}" if cache.compression else ""
    start = time.perf_counter()
    with tqdm(total=len(requests), desc=label, unit="task", file=sys.stderr, dynamic_ncols=True, leave=False) as progress:
        results = engine.generate(requests, on_finished=lambda _: progress.update())
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
    return {
        "policy": cache.policy,
        "scorer": cache.options.scorer if cache.policy == "kvpop" else None,
        **({"span_pooling": policy.span_pooling, "query_window": policy.query_window} if cache.policy == "kvpop" else {}),
        "budget": cache.budget,
        "compression_target": cache.compression,
        "sinks": getattr(cache.options, "sinks", None),
        "window": getattr(cache.options, "window", None),
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


# Named kvpop variants a sweep row may ask for with a suffix (`kvpop:mlstm+noquery`): what the service's
# parameters of the same name set (docs/CONFIGURATION.md: kvpop_query_window, kvpop_span_pooling). Plain
# `kvpop:SCORER` is the service default: query-aware where the scorer's model ships retrieval heads.
KVPOP_VARIANTS = {
    "query": {"query_window": query.WINDOW, "span_pooling": query.SPAN_POOLING},  # on, whatever the model ships
    "noquery": {"query_window": 0},  # the learned ranking alone, prompt spans as the scorer was trained
    "recency": {"fill": "recency"},  # the question's picks with the newest tokens in the other slots (no learned ranking)
}


def policy_config(policy: str, ratio: float | None, sinks: int = 4, window: int = 64, kvpop_options: dict | None = None,
                  budget: int | None = None) -> CacheConfig:
    """The cache of a sweep row named `policy`: NAME, kvpop:SCORER or kvpop:SCORER+VARIANT (KVPOP_VARIANTS), at
    compression `ratio` or `budget` slots (neither for full)."""
    name, _, scorer_name = policy.partition(":")
    scorer_name, _, variant = scorer_name.partition("+")
    if variant and variant not in KVPOP_VARIANTS:
        raise ValueError(f"unknown kvpop variant {variant!r} in {policy!r}; known: {sorted(KVPOP_VARIANTS)}")
    options = {**(kvpop_options or {}), **KVPOP_VARIANTS.get(variant, {})} if name == "kvpop" else {}
    return CacheConfig(policy=name, compression=ratio, budget=budget,
                       options=dict(sinks=sinks, window=window, scorer=scorer_name or "accumulated_attention", **options))


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
    kvpop_options: dict | None = None,
) -> list[dict]:
    """Every policy x compression. At 0% nothing is evicted, so every policy IS the full cache:
    full runs once and stands for all of them there. Without `run_full` (rows to merge into a sweep
    that has the full cache, `--merge`) only the listed policies run and only sweep.json is written.
    `kvpop_options`: the kvpop rows' policy options (span_pooling, query_window)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    header = stamp({"tasks": len(tasks), "scoring": scoring, "tasks_file": str(tasks_file) if tasks_file else None,
                    "tasks_sha256": hashlib.sha256(Path(tasks_file).read_bytes()).hexdigest() if tasks_file else None})

    def save(complete: bool) -> None:  # after every run: a long sweep cut short keeps what it measured
        (out_dir / "sweep.json").write_text(json.dumps({**header, "complete": complete, "results": summary}, indent=2) + "\n")
        if run_full:
            (out_dir / "sweep.md").write_text(markdown_table(summary, compressions))

    summary: list[dict] = []
    if run_full:
        full = evaluate(engine, tasks, CacheConfig(policy="full", options=dict(sinks=sinks, window=window)), max_tokens, scoring)
        summary.append(summary_row(full, "full", 0.0))
        save(False)
        print(f"full: accuracy {full['accuracy']:.3f} ({full['seconds']:.0f} s)", flush=True)
    for policy in policies:
        if policy == "full":
            continue
        for ratio in compressions:
            if ratio == 0.0:
                if run_full:
                    summary.append({**summary_row(full, policy, 0.0), "note": "no eviction at 0%: the full cache"})
                continue
            config = policy_config(policy, ratio, sinks, window, kvpop_options)
            report = evaluate(engine, tasks, config, max_tokens, scoring, label=policy)
            summary.append(summary_row(report, policy, ratio))
            save(False)
            print(f"{policy} @ {ratio:.0%}: accuracy {report['accuracy']:.3f} ({report['seconds']:.0f} s)", flush=True)
    save(True)
    if run_full:
        plot_sweep(summary, out_dir / "accuracy_vs_compression.png")
    return summary

