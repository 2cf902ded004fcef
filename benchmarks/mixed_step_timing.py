"""What the mixed decoder step saves: a decode batch and a prompt piece in one call or in two (a
program, not a test).

    python -m benchmarks.mixed_step_timing --model model_repository/kvpop_engine/1 --out docs/benchmarks/smollm2/mixed_step_timing.json

For a decode batch of B sequences over S cached slots and prompt pieces of T tokens (over the same
number of slots), times: the decode step alone and the piece alone, each through the lean step and
through the mixed step with an empty other segment (what the engine runs when a step has one kind of
work), and both together as two lean calls or one mixed call (`DecoderStep.run_mixed`, what the
engine runs when it has both). Medians of interleaved repetitions; writes JSON and a markdown table.
Each timed call follows an untimed one of its own: onnxruntime's worker threads of the session that
ran last spin for a while, and on a 2-core machine they slow another session's call by 10-40%
(the engine runs one session for all of this, so that cost is not the graphs').
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import numpy as np

from kvpop.decoder import DecoderStep, StepInputs


def segment(decoder: DecoderStep, batch: int, tokens: int, slots: int, rng: np.random.Generator) -> StepInputs:
    spec = decoder.spec
    shape = (spec.num_layers, batch, spec.num_kv_heads, slots, spec.head_dim)
    past = np.full(shape, 0.01, decoder.dtype)  # the values do not change the cost
    return StepInputs(
        rng.integers(3, spec.vocab_size, (batch, tokens)).astype(np.int64),
        np.tile(np.arange(slots, slots + tokens, dtype=np.int64), (batch, 1)),
        past, past.copy(), np.ones((batch, slots), bool),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help="an export with the mixed step (decoder_step.mixed.onnx)")
    parser.add_argument("--out", type=Path, help="JSON to write (a .md table is written beside it)")
    parser.add_argument("--batch", type=int, default=4, help="decode batch B")
    parser.add_argument("--slots", type=int, default=256, help="cached slots S of every sequence")
    parser.add_argument("--piece-tokens", type=int, nargs="+", default=[16, 64, 256], help="prompt piece sizes T")
    parser.add_argument("--repetitions", type=int, default=7)
    args = parser.parse_args(argv)

    mixed, lean = DecoderStep(args.model), DecoderStep(args.model, mixed=False)
    if not mixed.has_mixed_step:
        raise SystemExit(f"{args.model} has no mixed step: export it again (python -m export --model ...)")
    rng = np.random.default_rng(0)
    decode = segment(mixed, args.batch, 1, args.slots, rng)
    lean_call = lambda decoder, inputs: decoder.run(*inputs, last_only=True, attention=False)  # noqa: E731
    cases = {("decode", 0): {"lean": lambda: lean_call(lean, decode), "mixed": lambda: lean_call(mixed, decode)}}
    for tokens in args.piece_tokens:
        piece = segment(mixed, 1, tokens, args.slots, rng)
        cases[("piece", tokens)] = {"lean": lambda piece=piece: lean_call(lean, piece), "mixed": lambda piece=piece: lean_call(mixed, piece)}
        cases[("decode + piece", tokens)] = {
            "lean": lambda piece=piece: (lean_call(lean, decode), lean_call(lean, piece)),
            "mixed": lambda piece=piece: mixed.run_mixed(decode, piece),
        }
    times: dict = {case: {kind: [] for kind in calls} for case, calls in cases.items()}
    for calls in cases.values():  # warm up every session and shape
        for call in calls.values():
            call()
    for repetition in range(args.repetitions):
        for case, calls in cases.items():
            for kind in (("lean", "mixed") if repetition % 2 == 0 else ("mixed", "lean")):
                calls[kind]()  # untimed: the other session's idle threads still spin right after it ran
                start = time.perf_counter()
                calls[kind]()
                times[case][kind].append(time.perf_counter() - start)

    rows = []
    for (work, tokens), by_kind in times.items():
        lean_ms, mixed_ms = (statistics.median(by_kind[kind]) * 1e3 for kind in ("lean", "mixed"))
        rows.append({"work": work, "piece_tokens": tokens, "separate_or_lean_ms": lean_ms, "mixed_ms": mixed_ms,
                     "mixed_over_lean": mixed_ms / lean_ms})
    lines = [
        f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} on {platform.machine()}, model {args.model}; "
        f"decode batch B={args.batch}, S={args.slots} slots; medians of {args.repetitions} interleaved repetitions.\n",
        "| work | lean step ms (two calls for decode + piece) | mixed step ms (one call) | mixed / lean |",
        "|---|---|---|---|",
    ]
    for row in rows:
        label = f"decode B={args.batch}" if row["work"] == "decode" else f"{row['work']} T={row['piece_tokens']}"
        lines.append(f"| {label} | {row['separate_or_lean_ms']:.1f} | {row['mixed_ms']:.1f} | {row['mixed_over_lean']:.2f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"model": str(args.model), "batch": args.batch, "slots": args.slots,
                                        "repetitions": args.repetitions, "rows": rows}, indent=2) + "\n")
        args.out.with_suffix(".md").write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
