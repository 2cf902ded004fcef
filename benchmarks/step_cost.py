"""What one decode step costs by batch size and cached slots (a program, not a test): the bound a
bounded cache can buy on this device.

    python -m benchmarks.step_cost --model model_repository/kvpop_engine/1 --out build/results/step-cost/step_cost.json

Times the serving decode step (the lean variant: last-position logits, no attention) on random
caches of B sequences x S slots, medians of interleaved repetitions, and fits per batch size
step(S) = base + per_slot * S. `base` is what a step costs whatever the cache holds (on a CPU:
streaming the weights through the cores once per step), `per_slot` what each cached slot adds
(reading its keys and values). A bounded cache of b slots can make a decode step at most
(base + per_slot * S) / (base + per_slot * b) faster than the full cache at S slots: the ceiling
on workloads (b) and (c) of `make bench-service` on this device. Writes JSON and a markdown table.

With learned scorers exported beside the model, it also times what kvpop adds to each decode step:
one call of each scorer's decode batch graph for B sequences (`ScorerRuntime.step_decode_batch`).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import numpy as np

from kvpop.decoder import DecoderStep
from kvpop.policies.kvpop.runtime import ScorerRuntime

BATCHES = (1, 4, 8, 16)
SLOTS = (128, 512, 1024, 2048)
SCORER_CALLS = 4  # scorer calls per repetition (each takes milliseconds, a decode step tens)


def time_step(decoder: DecoderStep, batch: int, slots: int, rng: np.random.Generator) -> float:
    spec = decoder.spec
    shape = (spec.num_layers, batch, spec.num_kv_heads, slots, spec.head_dim)
    key = np.full(shape, 0.01, decoder.dtype)  # the values do not change the cost; filling is fast
    value = np.full(shape, -0.01, decoder.dtype)
    input_ids = rng.integers(3, spec.vocab_size, size=(batch, 1)).astype(np.int64)
    positions = np.full((batch, 1), slots, np.int64)
    mask = np.ones((batch, slots), bool)
    start = time.perf_counter()
    decoder.run(input_ids, positions, key, value, mask, last_only=True, attention=False)
    return time.perf_counter() - start


def time_scorer(runtime: ScorerRuntime, batch: int, rng: np.random.Generator) -> float:
    """One decode-batch call of a learned scorer for `batch` sequences, from their initial states."""
    spec = runtime.spec
    tokens = tuple(rng.standard_normal((batch, spec.num_layers, spec.num_kv_heads, spec.head_dim)).astype(np.float32)
                   for _ in range(4))  # new key, new value, leaving key, leaving value: (B, L, Hkv, D)
    states = [runtime.initial_state().recurrent for _ in range(batch)]
    start = time.perf_counter()
    runtime.step_decode_batch(states, tokens)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help="exported model directory")
    parser.add_argument("--out", type=Path, help="JSON to write (a .md table is written beside it)")
    parser.add_argument("--repetitions", type=int, default=5)
    parser.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    parser.add_argument("--slots", type=int, nargs="+", default=list(SLOTS))
    args = parser.parse_args(argv)
    decoder = DecoderStep(args.model)
    scorers = {kind: ScorerRuntime(args.model, kind) for kind in ScorerRuntime.available(args.model)}
    scorers = {kind: runtime for kind, runtime in scorers.items() if runtime.decode_session is not None}
    rng = np.random.default_rng(0)
    cells = [(batch, slots) for batch in args.batches for slots in args.slots]
    for batch, slots in cells:  # warm every shape once
        time_step(decoder, batch, slots, rng)
    for runtime in scorers.values():
        for batch in args.batches:
            time_scorer(runtime, batch, rng)
    samples: dict[tuple[int, int], list[float]] = {cell: [] for cell in cells}
    scorer_samples: dict[tuple[str, int], list[float]] = {(kind, b): [] for kind in scorers for b in args.batches}
    for repetition in range(args.repetitions):  # interleaved: a slow moment hits every cell alike
        for cell in cells:
            samples[cell].append(time_step(decoder, *cell, rng))
        for (kind, batch), times in scorer_samples.items():
            times.extend(time_scorer(scorers[kind], batch, rng) for _ in range(SCORER_CALLS))
        print(f"[step_cost] repetition {repetition + 1}/{args.repetitions}", flush=True)
    median_ms = {cell: statistics.median(times) * 1e3 for cell, times in samples.items()}
    scorer_ms = {cell: statistics.median(times) * 1e3 for cell, times in scorer_samples.items()}

    fits = {}
    lines = ["| batch | " + " | ".join(f"S={s} ms" for s in args.slots) + " | base ms | per slot us | ms per token at S=128 / 2048 |",
             "|---|" + "---|" * (len(args.slots) + 3)]
    for batch in args.batches:
        per_slot, base = np.polyfit(args.slots, [median_ms[(batch, s)] for s in args.slots], 1)
        fits[batch] = {"base_ms": float(base), "per_slot_ms": float(per_slot)}
        cells_text = " | ".join(f"{median_ms[(batch, s)]:.1f}" for s in args.slots)
        per_token = f"{median_ms[(batch, args.slots[0])] / batch:.1f} / {median_ms[(batch, args.slots[-1])] / batch:.1f}"
        lines.append(f"| {batch} | {cells_text} | {base:.1f} | {per_slot * 1e3:.1f} | {per_token} |")
    if scorers:  # what kvpop adds per decode step, beside the table
        lines += ["", "Learned scorer, one decode batch graph call (medians):"]
        lines += [f"- {kind}: " + ", ".join(f"B={b} {scorer_ms[(kind, b)]:.2f} ms" for b in args.batches) for kind in scorers]
    text = "\n".join(lines)
    header = (f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} on {platform.machine()}, "
              f"model {args.model}, lean decode step, medians of {args.repetitions} interleaved repetitions; "
              f"fit per batch: step = base + per_slot * S.\n\n")
    print(header + text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        report = {
            "model": str(args.model),
            "repetitions": args.repetitions,
            "median_ms": [{"batch": b, "slots": s, "ms": ms} for (b, s), ms in median_ms.items()],
            "fit": {str(batch): fit for batch, fit in fits.items()},
            "scorer_decode_batch_ms": [{"kind": kind, "batch": b, "ms": ms} for (kind, b), ms in scorer_ms.items()],
        }
        args.out.write_text(json.dumps(report, indent=2) + "\n")
        args.out.with_suffix(".md").write_text(header + text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
