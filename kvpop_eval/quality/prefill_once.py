"""Prefill once, evict many: every policy x compression of a task starts from ONE prefill of its prompt.

The per-cell harness (`harness.evaluate`) runs every task's prompt again for each policy x compression, and a
2,048-token prefill is most of a cell's time on a CPU. Here, as kvpress compresses one prefilled cache with
each press, a prompt is computed once with the full cache, in the pieces a kvpop request run alone is
computed in (`prefill_chunk` tokens at a time, the question's last `query_window` tokens as their own piece,
with attention). Each cell's cache is then built from those pieces: replayed into a new cache of that policy
and budget through the engine's own staging (`kvpop.cache.staging`: the same pieces, the same scorer calls,
the same one eviction with the question's attention), and the cells' answers decode together in engine
batches (`Engine.add_prefilled`), cells of one compression side by side. The answers are those of the
per-cell harness, up to floating-point rounding of differently padded calls (tests/evaluation/test_prefill_once.py).

Policies that read attention (H2O, TOVA) are scored here on the WHOLE prompt's attention, as kvpop and
SnapKV read the question's: H2O by what every prompt query put on each token, TOVA by the prompt's last
query (`CacheUpdate.prompt_attention`). The service evicts those two while prefilling (their rows would be
prompt x prompt); a harness that prefills once computes the sums as it goes.

Each cell also records whether its cache still holds the answer after the prompt's eviction (every token of
some occurrence of every answer item in every layer and KV head: `retention.task_retention`), so eviction
losses and model losses are told apart in the same run.

    python -m kvpop_eval.quality.prefill_once --model DIR --tasks FILE.jsonl --policies kvpop:mlstm,streaming \\
        --compressions 0.75,0.88,0.94 --out-dir DIR [--lines 1:200]

writes `tasks.jsonl` (one line per finished task: every cell's answer; a run resumes after its last line),
and `sweep.json`, `sweep.md` and the accuracy plot over the tasks done, in `harness.sweep`'s format (a
`--lines` piece carries its lines' digest, so `python -m kvpop_eval.quality --concat` joins the pieces).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from kvpop.cache.reservations import reserved_slots
from kvpop.cache.slot_cache import SlotCache
from kvpop.cache.staging import PromptStaging
from kvpop.decoder import StepOutput
from kvpop.engine import Engine
from kvpop.request import CacheConfig, GenerationRequest
from kvpop.sampling import Sampler, SamplingParams
from kvpop_eval.provenance import stamp
from kvpop_eval.quality.harness import policy_config
from kvpop_eval.quality.report import markdown_table, plot_sweep
from kvpop_eval.quality.retention import answer_occurrences, task_retention
from kvpop_eval.quality.tasks_io import encode, task_judge

DEFAULT_WINDOW = 32  # the last piece's tokens when no policy reads a question window (kvpop.policies.kvpop.query.WINDOW)


@dataclass
class PrefilledPrompt:
    """A prompt computed once with the full cache, in the pieces a kvpop request run alone is computed in."""

    prompt_ids: list[int]
    pieces: list[StepOutput]  # each piece's new keys and values, (L, 1, Hkv, t, D); the last piece's attention too
    first_logits: np.ndarray  # (V,) the last prompt position's
    prompt_attention: np.ndarray | None  # (L, Hq, P): what every prompt query put on each token; None unless asked

    @property
    def query_attention(self) -> np.ndarray:  # (L, Hq, W, P): the last piece's queries on every prompt token
        last = self.pieces[-1]
        return np.concatenate([last.attention[:, 0], last.chunk_attention[:, 0]], axis=-1)


def prefill(engine: Engine, prompt_ids: list[int], query_window: int, accumulate: bool) -> PrefilledPrompt:
    """`prompt_ids` through the decoder once: `prefill_chunk`-token pieces, then the last `query_window` tokens
    with attention. `accumulate`: every piece returns attention, summed into `prompt_attention`."""
    decoder, spec = engine.decoder, engine.spec
    length, window = len(prompt_ids), min(query_window, len(prompt_ids) - 1)
    step = engine.config.prefill_chunk
    bounds = [(start, min(start + step, length - window)) for start in range(0, length - window, step)]
    bounds.append((length - window, length))
    shape = (spec.num_layers, 1, spec.num_kv_heads, 0, spec.head_dim)
    past_key, past_value = np.zeros(shape, decoder.dtype), np.zeros(shape, decoder.dtype)
    received = np.zeros((spec.num_layers, spec.num_attention_heads, length), np.float32) if accumulate else None
    pieces = []
    for begin, end in bounds:
        last = end == length
        out = decoder.run(np.array([prompt_ids[begin:end]], np.int64), np.arange(begin, end, dtype=np.int64)[None],
                          past_key, past_value, np.ones((1, begin), bool), last_only=True, attention=last or accumulate)
        if received is not None:
            received[:, :, :begin] += out.attention[:, 0, :, :, :begin].sum(axis=2)
            received[:, :, begin:end] += out.chunk_attention[:, 0].sum(axis=2)
        past_key = np.concatenate([past_key, out.new_key], axis=3)
        past_value = np.concatenate([past_value, out.new_value], axis=3)
        pieces.append(out if last else StepOutput(out.logits, out.new_key, out.new_value))
    return PrefilledPrompt(list(prompt_ids), pieces, pieces[-1].logits[0, -1], received)


def branch(engine: Engine, prompt: PrefilledPrompt, config: CacheConfig, max_tokens: int) -> SlotCache:
    """The cache `config` keeps of the prefilled prompt: its pieces replayed into a new cache of that policy and
    budget as the engine's staging takes them (a policy that reads attention gets the whole prompt at once)."""
    policy = config.build_policy(engine.policy_assets)
    length = len(prompt.prompt_ids)
    budget = config.resolve_budget(length, max_tokens)
    cache = SlotCache(engine.spec, policy, budget, 0 if budget is None else reserved_slots(budget, length, max_tokens))
    cache.prompt_state = policy.prompt_state(prompt.prompt_ids, engine.tokenizer, engine.spec.vocab_size)
    if policy.needs_attention and policy.evicts:
        if prompt.prompt_attention is None:
            raise ValueError(f"{config.policy} reads attention: prefill the prompt with accumulate=True")
        empty = cache.capacity  # the reserved slots, all empty: their columns of attention are zeros
        key = np.concatenate([piece.new_key[:, 0] for piece in prompt.pieces], axis=2)  # (L, Hkv, P, D)
        value = np.concatenate([piece.new_value[:, 0] for piece in prompt.pieces], axis=2)
        query = np.pad(prompt.query_attention, ((0, 0), (0, 0), (0, 0), (empty, 0)))
        cache.append(key, value, None, None, query_attention=query,
                     prompt_attention=np.pad(prompt.prompt_attention, ((0, 0), (0, 0), (empty, 0))))
        return cache
    staging = PromptStaging(engine.spec)
    last = len(prompt.pieces) - 1
    for index, piece in enumerate(prompt.pieces):
        reads = index == last and policy.query_window > 0
        if reads and piece.new_key.shape[3] != policy.query_window:
            raise ValueError(f"{config.policy}: its question window is {policy.query_window} tokens, the prefill's last piece "
                             f"{piece.new_key.shape[3]}")
        if reads:  # the cache's reserved slots (all empty) come first in a call's past: their columns are zeros
            attention = np.pad(piece.attention, ((0, 0),) * 4 + ((cache.capacity, 0),))
            piece = StepOutput(piece.logits, piece.new_key, piece.new_value, attention, piece.chunk_attention)
        staging.store([cache], ["branch"], [length], piece if reads else StepOutput(piece.logits, piece.new_key, piece.new_value))
    return cache


@dataclass(frozen=True)
class Cell:
    policy: str  # a sweep row name (harness.policy_config)
    compression: float  # 0: the full cache

    @property
    def name(self) -> str:
        return f"{self.policy}@{self.compression:g}"


def run_task(engine: Engine, task: dict, cells: list[Cell], configs: dict[Cell, CacheConfig], max_tokens: int,
             is_correct, accumulate: bool, query_window: int) -> dict:
    """One task: its prompt prefilled once, every cell's cache built from it and checked for the answer, the
    answers decoded in engine batches (a compression's cells together); one record of every cell's result."""
    started = time.perf_counter()
    prompt_ids = encode(engine.tokenizer, task["prompt"])
    prompt = prefill(engine, prompt_ids, query_window, accumulate)
    occurrences = answer_occurrences(engine.tokenizer, task["prompt"], prompt_ids, task["answer"])
    prefill_seconds = time.perf_counter() - started
    sampling = SamplingParams(max_tokens=max_tokens)
    first_token = Sampler(sampling)(prompt.first_logits)
    results: dict[str, dict] = {}
    for ratio in dict.fromkeys(cell.compression for cell in cells):
        group = [cell for cell in cells if cell.compression == ratio]
        requests = []
        for cell in group:
            cache = branch(engine, prompt, configs[cell], max_tokens)
            kept = task_retention(cache.position.copy(), occurrences)
            results[cell.name] = {"in_cache": kept.retained if kept.found else None, "answer_token_share": kept.token_share}
            request = GenerationRequest(f"{task.get('index', 0)}:{cell.name}", prompt_ids, sampling, configs[cell])
            engine.add_prefilled(request, cache, first_token)
            requests.append((cell, request))
        pending = {request.request_id for _, request in requests}
        while pending:
            pending -= {event.request_id for event in engine.step() if event.finished}
        for cell, request in requests:
            result = engine.result(request.request_id)
            text = engine.tokenizer.decode(result.output_ids, skip_special_tokens=True)
            results[cell.name].update(generated=text, correct=bool(is_correct(text, task)), budget=result.budget,
                                      compression=result.compression, output_tokens=len(result.output_ids),
                                      peak_kv_bytes=result.peak_kv_bytes)
    meta = {key: task[key] for key in ("family", "source", "split", "context_tokens", "layout", "facts") if key in task}
    return {"index": task.get("index"), **meta, "answer": task["answer"], "prompt_tokens": len(prompt_ids),
            "prefill_seconds": prefill_seconds, "seconds": time.perf_counter() - started, "cells": results}


def summarize(records: list[dict], cells: list[Cell], configs: dict[Cell, CacheConfig], engine: Engine | None = None) -> list[dict]:
    """Sweep rows (harness.sweep's format: one per cell, `correct_by_task` in task order) from task records."""
    rows = []
    for cell in cells:
        mine = [record["cells"][cell.name] for record in records]
        count = len(mine)
        row = {"policy": cell.policy, "compression": cell.compression, "tasks": count,
               "accuracy": sum(result["correct"] for result in mine) / count,
               "compression_achieved": sum(result["compression"] for result in mine) / count,
               "mean_budget": sum(result["budget"] for result in mine) / count,
               "max_peak_kv_bytes": max(result["peak_kv_bytes"] for result in mine),
               "correct_by_task": "".join("1" if result["correct"] else "0" for result in mine),
               "in_cache_by_task": "".join("-" if result["in_cache"] is None else "1" if result["in_cache"] else "0"
                                           for result in mine),
               "harness": "prefill_once"}
        if engine is not None and cell.policy.startswith("kvpop"):
            policy = configs[cell].build_policy(engine.policy_assets)
            row.update(query_window=policy.query_window, span_pooling=policy.span_pooling)
        rows.append(row)
    return rows


def sweep_cells(policies: list[str], compressions: tuple[float, ...]) -> list[Cell]:
    """The full cache, then every policy at every non-zero compression (`POLICY@RATIO`: that one only)."""
    cells = [Cell(policy, ratio) for ratio in compressions if ratio for policy in policies if policy != "full" and "@" not in policy]
    cells += [Cell(policy.partition("@")[0], float(policy.partition("@")[2])) for policy in policies if "@" in policy]
    return [Cell("full", 0.0)] + cells


def run(engine: Engine, lines: list[str], tasks_file: str, out_dir: Path, policies: list[str],
        compressions: tuple[float, ...], max_tokens: int, scoring: str, sinks: int, window: int,
        kvpop_options: dict | None = None, run_tasks: bool = True) -> list[dict]:
    """Every task (a line of `lines`) not yet in out_dir/tasks.jsonl, then the sweep over the tasks done: its digest
    is of their lines, so a piece cut short still joins the lines before it (`quality --concat`)."""
    tasks = [json.loads(line) for line in lines]
    cells = sweep_cells(policies, compressions)
    configs = {cell: CacheConfig(policy="full") if cell.policy == "full"
               else policy_config(cell.policy, cell.compression, sinks, window, kvpop_options) for cell in cells}
    built = [configs[cell].build_policy(engine.policy_assets) for cell in cells]
    windows = {policy.query_window for policy in built if policy.query_window > 0} or {DEFAULT_WINDOW}
    if len(windows) != 1:
        raise ValueError(f"the policies read question windows of different lengths {sorted(windows)}: run them apart")
    query_window = windows.pop()
    accumulate = any(policy.needs_attention and policy.evicts for policy in built)
    out_dir.mkdir(parents=True, exist_ok=True)
    done_file = out_dir / "tasks.jsonl"
    records = [json.loads(line) for line in done_file.read_text().splitlines()] if done_file.exists() else []
    names = {cell.name for cell in cells}
    if records and set(records[0]["cells"]) != names:
        raise ValueError(f"{done_file} holds other cells ({sorted(records[0]['cells'])}); use a new --out-dir")
    is_correct = task_judge(scoring)
    with tqdm(total=len(tasks), initial=len(records), desc="tasks", unit="task", file=sys.stderr, dynamic_ncols=True) as progress:
        for task in tasks[len(records):] if run_tasks else ():
            record = run_task(engine, task, cells, configs, max_tokens, is_correct, accumulate, query_window)
            with done_file.open("a") as handle:
                handle.write(json.dumps(record) + "\n")
            records.append(record)
            progress.update()
    summary = summarize(records, cells, configs, engine)
    digest = hashlib.sha256("".join(lines[: len(records)]).encode()).hexdigest()
    header = stamp({"tasks": len(records), "scoring": scoring, "tasks_file": tasks_file, "tasks_sha256": digest,
                    "complete": len(records) == len(tasks), "harness": "prefill_once", "max_tokens": max_tokens,
                    "prefill_seconds": sum(record["prefill_seconds"] for record in records),
                    "seconds": sum(record["seconds"] for record in records)})
    (out_dir / "sweep.json").write_text(json.dumps({**header, "results": summary}, indent=2) + "\n")
    ratios = tuple(sorted({cell.compression for cell in cells}))
    (out_dir / "sweep.md").write_text(markdown_table(summary, ratios))
    plot_sweep(summary, out_dir / "accuracy_vs_compression.png")
    return summary


def line_range(text: str) -> tuple[int, int]:
    """"A:B" -> lines A to B of the tasks file, counted from 1, both included."""
    first, _, last = text.partition(":")
    if not (first.isdigit() and last.isdigit()) or not 1 <= int(first) <= int(last):
        raise argparse.ArgumentTypeError(f"--lines wants FIRST:LAST (from 1), got {text!r}")
    return int(first), int(last)


def main(argv: list[str] | None = None) -> int:
    from kvpop_eval.engine_factory import build_engine

    parser = argparse.ArgumentParser(prog="python -m kvpop_eval.quality.prefill_once", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True, help="exported model directory (decoder_step.onnx)")
    parser.add_argument("--tasks", type=Path, required=True, help="JSONL with 'prompt' and 'answer' per line")
    parser.add_argument("--lines", type=line_range, help="FIRST:LAST: this piece of the tasks file only (a resumable plan's piece)")
    parser.add_argument("--policies", required=True,
                        help="comma-separated sweep names (harness.policy_config), NAME@RATIO for one compression; full always runs")
    parser.add_argument("--compressions", default="0.75,0.88,0.94")
    parser.add_argument("--scoring", choices=["final_answer", "contains", "fact"], default="contains")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--sinks", type=int, default=4)
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=16, help="cells decoded in one engine batch")
    parser.add_argument("--prefill-chunk", type=int, default=256)
    parser.add_argument("--out-dir", type=Path, required=True)
    parser.add_argument("--summarize", action="store_true", help="run no task: the sweep of the tasks already in --out-dir")
    args = parser.parse_args(argv)

    lines = args.tasks.read_text().splitlines(keepends=True)
    first, last = args.lines or (1, len(lines))
    if last > len(lines):
        parser.error(f"--lines {first}:{last}: the tasks file has {len(lines)} lines")
    policies = [name.strip() for name in args.policies.split(",") if name.strip()]
    compressions = tuple(float(ratio) for ratio in args.compressions.split(","))
    engine = build_engine(args.model, max_batch_size=args.batch_size, prefill_chunk=args.prefill_chunk)
    run(engine, lines[first - 1 : last], str(args.tasks), args.out_dir, policies, compressions,
        args.max_tokens, args.scoring, args.sinks, args.window, run_tasks=not args.summarize)
    print(f"wrote {args.out_dir}/tasks.jsonl, sweep.json, sweep.md, accuracy_vs_compression.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
