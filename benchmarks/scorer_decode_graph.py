"""The mLSTM scorer's decode call, two exports side by side (a program, not a test).

    git worktree add /tmp/s9 69a84f4   # or any older commit
    (cd /tmp/s9 && python -m kvpop_train.scorer.onnx_export --scorers MODEL/scorer --out /tmp/old)
    python -m benchmarks.scorer_decode_graph --old /tmp/old --new EXPORT_DIR --out docs/benchmarks/x.json

Times onnxruntime calls of the old export's decode graph and the new one's on the same inputs,
interleaved, one thread each; reports medians and the max |score difference| (None where the old
graph returned NaN on these off-distribution inputs). The old graph is `scorer_mlstm.decode.onnx`
(sequences in the token axis (L, Hkv, B, ...), session 10 on) or, in an export from before session
10, the chunk-form batch graph `scorer_mlstm.batch.onnx` (inputs (B, L, Hkv, 1, D)).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

TOKENS = ("new_key", "new_value", "leaving_key", "leaving_value")
STATES = ("memory", "normaliser", "stabiliser")


def session(path: Path) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def compare(old_dir: Path, new_dir: Path, batches: list[int], calls: int) -> dict[str, dict]:
    config = json.loads((new_dir / "scorer_mlstm.json").read_text())["config"]
    layers, heads, dim, memory = config["num_layers"], config["num_kv_heads"], config["head_dim"], config["memory_dim"]
    old_is_batch = not (old_dir / "scorer_mlstm.decode.onnx").exists()
    old = session(old_dir / ("scorer_mlstm.batch.onnx" if old_is_batch else "scorer_mlstm.decode.onnx"))
    new = session(new_dir / "scorer_mlstm.decode.onnx")
    old_label = "chunk-form batch graph" if old_is_batch else "old decode graph"
    rng, rows = np.random.default_rng(0), {}
    for batch in batches:
        tokens = [rng.standard_normal((batch, layers, heads, dim)).astype(np.float32) for _ in TOKENS]  # (B, L, Hkv, D)
        states = [np.zeros((batch, layers, heads, *shape), np.float32) for shape in ((memory, memory), (memory,), ())]
        new_feed = {name: np.ascontiguousarray(array.transpose(1, 2, 0, 3)) for name, array in zip(TOKENS, tokens)}
        new_feed |= {name: np.ascontiguousarray(np.moveaxis(array, 0, 2)) for name, array in zip(STATES, states)}
        if old_is_batch:
            old_feed = {name: array[:, :, :, None].copy() for name, array in zip(TOKENS, tokens)} | dict(zip(STATES, states))
            old_score = old.run(None, old_feed)[0][..., 0]
        else:
            old_feed = new_feed
            old_score = old.run(None, old_feed)[0].transpose(2, 0, 1)
        new_score = new.run(None, new_feed)[0].transpose(2, 0, 1)
        diff = float(np.abs(old_score - new_score).max())
        times: dict[str, list[float]] = {"old": [], "new": []}
        for _ in range(calls):
            for name, graph, feed in (("old", old, old_feed), ("new", new, new_feed)):
                start = time.perf_counter()
                graph.run(None, feed)
                times[name].append(time.perf_counter() - start)
        row = {"old_us": 1e6 * statistics.median(times["old"]), "new_us": 1e6 * statistics.median(times["new"]),
               "max_abs_score_diff": None if np.isnan(diff) else diff}
        row["old_over_new"] = row["old_us"] / row["new_us"]
        rows[f"B={batch}"] = row
        print(f"[scorer-decode-graph] B={batch:3d}  {old_label} {row['old_us']:8.1f} us  "
              f"new decode graph {row['new_us']:8.1f} us  {row['old_over_new']:.2f}x  |score diff| {row['max_abs_score_diff']}")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scorer_decode_graph", description=__doc__.splitlines()[0])
    parser.add_argument("--old", type=Path, required=True, help="the older export (scorer_mlstm.decode.onnx or .batch.onnx)")
    parser.add_argument("--new", type=Path, required=True, help="export with scorer_mlstm.decode.onnx")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 16])
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    report = {"measured": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "old": str(args.old), "new": str(args.new),
              "results": compare(args.old, args.new, args.batches, args.calls)}
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
