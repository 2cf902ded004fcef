"""What the learned KVpop scorers cost: kvpop's own per-step overhead over `streaming` at the same
budget (which scores nothing), and the scorer call alone, as a vectorised decode step makes it.

The scorers are the model directory's; `scratch_model_dir` makes a copy of the directory with an
initialised, untrained scorer of the model's shape for each kind the model lacks: a scorer's cost
does not depend on its weight values.
"""

from __future__ import annotations

import json
import shutil
import statistics
import time
from pathlib import Path

import numpy as np

from kvpop.policies.kvpop.scorers import TokenScorer


UNTRAINED = "untrained: initialised (seed 0) by kvpop_eval.bench.decoder for timing only"


def scratch_model_dir(model_dir: Path, scratch: Path, kinds: set[str], window: int) -> Path:
    """A copy of the export `model_dir` in `scratch` (a re-export of `model_dir` mid-run cannot change
    the graphs being timed; the weights are copied, not linked: onnxruntime refuses external data
    outside the model's directory) with a learned scorer of every kind in `kinds`: the model's own
    where it has one, else an initialised, UNTRAINED scorer of the model's shape with protected
    window `window` (speed only). Files already copied (same size and time) are kept."""
    model_dir, scratch = Path(model_dir).resolve(), Path(scratch)
    scratch.mkdir(parents=True, exist_ok=True)
    for source in model_dir.iterdir():
        if source.name == "__pycache__":
            continue
        target = scratch / source.name
        if source.is_file() and target.is_file() and not target.is_symlink():
            mine, theirs = target.stat(), source.stat()
            if (mine.st_size, mine.st_mtime_ns) == (theirs.st_size, theirs.st_mtime_ns):
                continue
        if target.is_symlink() or target.is_file():
            target.unlink()
        elif target.is_dir():
            shutil.rmtree(target)
        if source.is_dir():
            shutil.copytree(source, target)
        else:
            shutil.copy2(source, target)
    missing = sorted(kind for kind in kinds if not (model_dir / f"scorer_{kind}.json").exists())
    if missing:
        import torch

        from kvpop_train.scorer.network import Scorer, ScorerConfig
        from export.scorer_onnx import export_scorer

        spec = json.loads((model_dir / "model_spec.json").read_text())
        for kind in missing:
            config = ScorerConfig(kind=kind, num_layers=spec["num_layers"], num_kv_heads=spec["num_kv_heads"], head_dim=spec["head_dim"], window=window)
            previous = scratch / f"scorer_{kind}.json"
            earlier = json.loads(previous.read_text()) if previous.exists() else {}
            if earlier.get("source") == UNTRAINED and earlier.get("config") == config.to_dict():
                continue  # exported by an earlier run
            torch.manual_seed(0)
            exported = export_scorer(Scorer(config), scratch, source=UNTRAINED)
            print(f"exported an untrained {kind} scorer of the model's shape (window {window}) to {exported.onnx_path} (parity {exported.max_abs_diff:.1e})", flush=True)
    return scratch


def scorer_notes(model_dir: Path, kinds: set[str]) -> dict[str, dict]:
    """What each learned scorer in use is: its window, shape and where its weights came from."""
    notes = {}
    for kind in sorted(kinds):
        data = json.loads((Path(model_dir) / f"scorer_{kind}.json").read_text())
        notes[kind] = {
            "window": data["config"]["window"], "memory_dim": data["config"].get("memory_dim"), "hidden_dim": data["config"].get("hidden_dim"),
            "source": data.get("source", ""), "trained": data.get("source", "") != UNTRAINED,
            "batch_graph": data.get("decode_onnx_file"),
        }
    return notes


def time_scorer_calls(learned_scorers: dict[str, TokenScorer], kinds: set[str], spec, batches, repeats: int = 40, warmup: int = 3) -> list[dict]:
    """The learned scorer alone, as one vectorised decode step calls it: `score_decode_batch` on B
    sequences' new and leaving tokens, (B, L, Hkv, D) each (medians of `repeats` calls). For a
    stateful kind at B > 1 (the engine runs its tiled batch graph) it also times the alternative,
    B calls of the one-sequence step, interleaved with it call by call."""
    rng = np.random.default_rng(0)
    rows = []
    for kind in sorted(kinds):
        scorer = learned_scorers[kind]
        runtime = scorer.runtime
        for batch in batches:
            tokens = [rng.standard_normal((batch, spec.num_layers, spec.num_kv_heads, spec.head_dim)).astype(np.float32) for _ in range(4)]
            states = [scorer.init_state() for _ in range(batch)]

            def one_by_one() -> None:
                for row, state in enumerate(states):
                    runtime.step(state.recurrent, *(array[row, :, :, None] for array in tokens))

            variants = {"engine": lambda: scorer.score_decode_batch(states, *tokens)}
            if runtime.spec.state_shapes and runtime.decode_session is not None and batch > 1:
                variants["one_sequence_calls"] = one_by_one
            times: dict[str, list[float]] = {name: [] for name in variants}
            for _ in range(warmup + repeats):
                for name, call in variants.items():
                    start = time.perf_counter()
                    call()
                    times[name].append(time.perf_counter() - start)
            row = {"kind": kind, "batch": batch, "calls_timed": repeats}
            for name, values in times.items():
                median = statistics.median(values[warmup:])
                prefix = "call" if name == "engine" else name
                row[f"{prefix}_ms"] = 1000 * median
                row[f"{prefix}_p90_ms"] = 1000 * float(np.percentile(values[warmup:], 90))
            row["ms_per_sequence"] = row["call_ms"] / batch
            rows.append(row)
    return rows


def policy_overheads(report: dict) -> list[dict]:
    """Each kvpop system's step time minus `streaming`'s at the same budget, context and batch:
    what kvpop's scoring and bookkeeping add (streaming evicts by position and scores nothing)."""
    table = []
    for row in report["decode"]:
        policy, _, budget = row["system"].rpartition("-")
        if not policy.startswith("kvpop"):
            continue
        baseline = [r for r in report["decode"] if r["system"] == f"streaming-{budget}" and r["context"] == row["context"] and r["batch"] == row["batch"]]
        if baseline:
            base = baseline[0]["step_latency_s"]
            table.append({
                "system": row["system"], "versus": f"streaming-{budget}", "context": row["context"], "batch": row["batch"],
                "overhead_ms_per_step": 1000 * (row["step_latency_s"] - base), "overhead_ms_per_token": 1000 * (row["step_latency_s"] - base) / row["batch"],
                "overhead_fraction": row["step_latency_s"] / base - 1,
            })
    return table


def overhead_lines(report: dict, target_context: int = 8192) -> list[str]:
    contexts = {row["context"] for row in report["policy_overhead"]}
    if not contexts:
        return []
    context = min(contexts, key=lambda c: abs(c - target_context))
    lines = [
        f"context {context}, batch {e['batch']}: {e['system']} - {e['versus']}: {e['overhead_ms_per_step']:+.2f} ms/step ({100 * e['overhead_fraction']:+.1f}%)"
        for e in report["policy_overhead"] if e["context"] == context
    ]
    for r in report["scorer_calls"]:
        alternative = f"; {r['batch']} one-sequence calls: {r['one_sequence_calls_ms']:.2f} ms" if "one_sequence_calls_ms" in r else ""
        lines.append(f"scorer call alone: {r['kind']} batch {r['batch']}: {r['call_ms']:.2f} ms/step ({r['ms_per_sequence']:.3f} ms per sequence){alternative}")
    return lines
