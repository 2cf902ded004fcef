"""What the lean decoder-step variants save on one call (a program, not a test).

    python -m benchmarks.step_variants_timing --model model_repository/kvpop_engine/1

Times one prefill chunk (T new tokens over S cached slots) and one decode step (batch B) through
the full exported step (every position's logits, attention copied out), the attention variant
(last-position logits, attention) and the lean variant (last-position logits, no attention):
medians of interleaved repetitions. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np

from kvpop.decoder import DecoderStep

VARIANTS = {"full step": (False, True), "last logits + attention": (True, True), "lean (last logits only)": (True, False)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--repetitions", type=int, default=5)
    args = parser.parse_args(argv)
    decoder = DecoderStep(args.model)
    if not decoder.has_lean_variants:
        raise SystemExit(f"{args.model} has no step variants: python -m export.step_variants {args.model}")
    spec = decoder.spec
    rng = np.random.default_rng(0)
    print(f"model {args.model} ({spec.num_layers} layers, vocab {spec.vocab_size})\n")
    print("| call | " + " | ".join(f"{name} ms" for name in VARIANTS) + " | lean / full |")
    print("|---|" + "---|" * (len(VARIANTS) + 1))
    for label, batch, tokens, slots in (("prefill chunk T=256, S=1792", 1, 256, 1792), ("decode B=8, S=2048", 8, 1, 2048)):
        shape = (spec.num_layers, batch, spec.num_kv_heads, slots, spec.head_dim)
        key = rng.standard_normal(shape).astype(decoder.dtype)
        value = rng.standard_normal(shape).astype(decoder.dtype)
        inputs = (np.zeros((batch, tokens), np.int64), np.tile(np.arange(slots, slots + tokens), (batch, 1)), key, value,
                  np.ones((batch, slots), bool))
        times = {name: [] for name in VARIANTS}
        for repetition in range(args.repetitions + 1):
            for name, (last_only, attention) in VARIANTS.items():
                start = time.perf_counter()
                decoder.run(*inputs, last_only=last_only, attention=attention)
                if repetition:  # the first round warms up
                    times[name].append(time.perf_counter() - start)
        medians = {name: 1e3 * statistics.median(values) for name, values in times.items()}
        cells = " | ".join(f"{medians[name]:.1f}" for name in VARIANTS)
        print(f"| {label} | {cells} | {medians['lean (last logits only)'] / medians['full step']:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
