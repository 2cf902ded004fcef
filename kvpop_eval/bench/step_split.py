"""A decode step's time split into weights and KV traffic (a program, not a test): why a bounded cache
decodes faster, on this machine and, as a prediction, on a GPU.

    python -m kvpop_eval.bench.step_split --model model_repository/kvpop_engine/1 --out-dir build/results/step-split

A decode step reads every weight once, whatever the batch, and then the cache of every running
sequence. Its physical floor is the bytes it must move over the memory bandwidth:

    floor = (weight bytes + batch x slots x KV bytes per slot) / bandwidth

This program measures the bandwidth (numpy streams over arrays far larger than the caches), times the
exported decoder step (`DecoderStep.run`, the engine's decode call) at batch 1 and 8 over contexts of
1k-4k tokens, for the full cache (every token a slot) and kvpop at 88% (12% of the tokens as slots),
repetitions interleaved, and fits the measured times to `fixed + per_slot x batch x slots`: the fixed
part is what the weights (and the per-call overhead) cost, the per-slot part what the KV traffic and the
attention over it cost. The same floor with a GPU's bandwidth (`--gpu-bandwidth`, ~3 TB/s for an H100's
HBM3) is written beside it as a prediction, never as a measurement. Writes step_split.json, step_split.md
and step_split.png into --out-dir.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import threading
import time
from pathlib import Path

import numpy as np

from kvpop_eval.provenance import save_report
from kvpop_eval.timing import medians

COMPRESSION = 0.88
H100_BANDWIDTH = 3.0e12  # bytes/s: an H100's HBM3 (3.35 TB/s SXM, 2.0 PCIe), rounded as "~3 TB/s"


def kvpop_slots(tokens: int, compression: float = COMPRESSION) -> int:
    """Slots per head of a kvpop cache that has seen `tokens` (kvpop.request.CacheConfig.resolve_budget)."""
    return max(1, math.ceil((1.0 - compression) * tokens))


def stream_bandwidth(megabytes: int = 512, threads: int | None = None, rounds: int = 5) -> dict[str, float]:
    """Bytes/s this machine's memory delivers: the best of `rounds` for a read (max, vectorised and not
    compute-bound) and a copy (read + write, counted twice as STREAM does), split over `threads` numpy
    threads (numpy releases the GIL)."""
    threads = threads or os.cpu_count() or 1
    source = np.ones(megabytes * 2**20 // 4, np.float32)
    target = np.empty_like(source)
    parts = np.array_split(np.arange(len(source)), threads)
    bounds = [(int(part[0]), int(part[-1]) + 1) for part in parts if len(part)]

    def best(work, bytes_moved: int) -> float:
        times = []
        for _ in range(rounds):
            workers = [threading.Thread(target=work, args=bound) for bound in bounds]
            start = time.perf_counter()
            for worker in workers:
                worker.start()
            for worker in workers:
                worker.join()
            times.append(time.perf_counter() - start)
        return bytes_moved / min(times)

    read = best(lambda low, high: source[low:high].max(), source.nbytes)
    copy = best(lambda low, high: np.copyto(target[low:high], source[low:high]), 2 * source.nbytes)
    return {"read_bytes_per_s": read, "copy_bytes_per_s": copy, "floor_bytes_per_s": max(read, copy), "threads": threads,
            "array_mb": megabytes}


def weight_bytes(model_dir: Path) -> int:
    """Bytes of the decoder's weights: its ONNX file and external data (what every step streams once)."""
    from kvpop.model_spec import ModelSpec

    decoder = Path(model_dir) / ModelSpec.load(model_dir).decoder_file
    data = decoder.with_name(decoder.name + ".data")
    return decoder.stat().st_size + (data.stat().st_size if data.exists() else 0)


def time_steps(model_dir: Path, batches: list[int], contexts: list[int], rounds: int, threads: int | None,
               device: str = "cpu") -> list[dict]:
    """Median seconds of one decode step per (batch, context, cache), full and kvpop interleaved. On
    "cuda" the caches live in device memory (bound in place, as the engine's device store keeps them)."""
    import onnxruntime as ort

    from kvpop.decoder import DecoderStep

    decoder = DecoderStep(model_dir, device=device, threads=threads)
    spec = decoder.spec
    rng = np.random.default_rng(0)
    rows = []
    for batch in batches:
        for context in contexts:
            cases, shapes = {}, {}
            for cache, slots in (("full", context), ("kvpop", kvpop_slots(context))):
                past_key, past_value, mask = decoder.empty_cache(batch, slots)  # (L, B, Hkv, S, D) x2, (B, S)
                past_key[...] = rng.standard_normal(past_key.shape, np.float32).astype(decoder.dtype)
                past_value[...] = rng.standard_normal(past_value.shape, np.float32).astype(decoder.dtype)
                mask[...] = True
                ids = rng.integers(3, spec.vocab_size, size=(batch, 1)).astype(np.int64)
                positions = np.full((batch, 1), context, np.int64)
                if device == "cuda":
                    past_key, past_value = (ort.OrtValue.ortvalue_from_numpy(array, "cuda", 0) for array in (past_key, past_value))
                arrays = (ids, positions, past_key, past_value, mask)
                cases[cache] = lambda arrays=arrays: decoder.run(*arrays, last_only=True, attention=False)
                shapes[cache] = slots
            for cache, (median, samples) in medians(cases, rounds, warmup=1).items():
                rows.append({"batch": batch, "context": context, "cache": cache, "slots": shapes[cache],
                             "kv_bytes": batch * shapes[cache] * spec.kv_bytes_per_token, "median_s": median, "samples_s": samples})
                print(f"[step-split] batch {batch} context {context:5d} {cache:5s} ({shapes[cache]:5d} slots): "
                      f"{median * 1e3:7.1f} ms", flush=True)
    return rows


def fit(rows: list[dict]) -> tuple[float, float]:
    """Least squares of median seconds = fixed + per_slot x (batch x slots): (fixed s, seconds per slot)."""
    slots = np.array([row["batch"] * row["slots"] for row in rows], np.float64)
    seconds = np.array([row["median_s"] for row in rows], np.float64)
    design = np.stack([np.ones_like(slots), slots], axis=1)
    (fixed, per_slot), *_ = np.linalg.lstsq(design, seconds, rcond=None)
    return float(fixed), float(per_slot)


def split(rows: list[dict], weights: int, bandwidth: float, fixed: float, per_slot: float, gpu_bandwidth: float,
          kv_bytes_per_token: int) -> list[dict]:
    """Each row with its floor (weights and KV over the measured bandwidth), its fitted split, and the
    GPU floor predicted for the same bytes in float32 and in float16 (half of every byte)."""
    out = []
    for row in rows:
        kv_slots = row["batch"] * row["slots"]
        out.append({
            **row,
            "floor_weights_s": weights / bandwidth,
            "floor_kv_s": row["kv_bytes"] / bandwidth,
            "fitted_fixed_s": fixed,
            "fitted_kv_s": per_slot * kv_slots,
            "kv_share_measured": per_slot * kv_slots / row["median_s"],
            "predicted_gpu_fp32_s": (weights + row["kv_bytes"]) / gpu_bandwidth,
            "predicted_gpu_fp16_s": (weights + row["kv_bytes"]) / 2 / gpu_bandwidth,
        })
    return out


def ratios(rows: list[dict]) -> list[dict]:
    """full / kvpop per (batch, context): measured, on this machine's floor, on the GPU's floor."""
    by = {(row["batch"], row["context"], row["cache"]): row for row in rows}
    result = []
    for batch, context in sorted({(row["batch"], row["context"]) for row in rows}):
        full, kvpop = by[(batch, context, "full")], by[(batch, context, "kvpop")]
        floor = lambda row: row["floor_weights_s"] + row["floor_kv_s"]  # noqa: E731
        result.append({"batch": batch, "context": context,
                       "measured_full_over_kvpop": full["median_s"] / kvpop["median_s"],
                       "floor_full_over_kvpop": floor(full) / floor(kvpop),
                       "predicted_gpu_full_over_kvpop": full["predicted_gpu_fp32_s"] / kvpop["predicted_gpu_fp32_s"]})
    return result


def gpu_predictions(weights: int, kv_bytes_per_token: int, batches: list[int], contexts: list[int], bandwidth: float) -> list[dict]:
    """The floor alone (no measurement) at a GPU's bandwidth, in float16 (half of every byte), at the larger
    batches a GPU serves: full and kvpop step time and their ratio per (batch, context)."""
    rows = []
    for batch in batches:
        for context in contexts:
            step = lambda slots: (weights + batch * slots * kv_bytes_per_token) / 2 / bandwidth  # noqa: E731
            full, kvpop = step(context), step(kvpop_slots(context))
            rows.append({"batch": batch, "context": context, "full_fp16_s": full, "kvpop_fp16_s": kvpop, "full_over_kvpop": full / kvpop})
    return rows


def markdown(report: dict) -> str:
    bandwidth = report["bandwidth"]
    source = ("nominal (the GPU's stated bandwidth, not measured)" if bandwidth.get("nominal") else
              f"numpy, {bandwidth['threads']} threads, {bandwidth['array_mb']} MB arrays")
    lines = [
        f"Measured {report['date']} on {report['machine']} (load average {report['load_average']:.1f}); model "
        f"`{report['model']}`: {report['weight_bytes'] / 1e6:.0f} MB of weights, {report['kv_bytes_per_token'] / 1e3:.1f} kB "
        f"of KV per token; kvpop at {COMPRESSION:.0%} (12% of the tokens as slots); medians of {report['rounds']} "
        f"interleaved repetitions.",
        "",
        f"Memory bandwidth ({source}): read "
        f"{bandwidth['read_bytes_per_s'] / 1e9:.1f} GB/s, copy {bandwidth['copy_bytes_per_s'] / 1e9:.1f} GB/s; the floor "
        f"uses the better, {bandwidth['floor_bytes_per_s'] / 1e9:.1f} GB/s. Fit over every row: step = {report['fit']['fixed_s'] * 1e3:.1f} ms + "
        f"{report['fit']['per_slot_s'] * 1e6:.2f} µs x batch x slots (the floor's KV term: "
        f"{report['kv_bytes_per_token'] / bandwidth['floor_bytes_per_s'] * 1e6:.2f} µs a slot).",
        "",
        "| batch | context | cache | slots | KV read MB | measured ms | floor weights / KV ms | fitted fixed / KV ms "
        "| KV share (fit) | GPU floor fp32 / fp16 ms (predicted) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in report["rows"]:
        lines.append(
            f"| {row['batch']} | {row['context']} | {row['cache']} | {row['slots']} | {row['kv_bytes'] / 1e6:.0f} | "
            f"{row['median_s'] * 1e3:.1f} | {row['floor_weights_s'] * 1e3:.1f} / {row['floor_kv_s'] * 1e3:.1f} | "
            f"{row['fitted_fixed_s'] * 1e3:.1f} / {row['fitted_kv_s'] * 1e3:.1f} | {row['kv_share_measured']:.0%} | "
            f"{row['predicted_gpu_fp32_s'] * 1e3:.2f} / {row['predicted_gpu_fp16_s'] * 1e3:.2f} |")
    lines += ["", "| batch | context | full / kvpop measured | full / kvpop on this machine's floor | "
              f"full / kvpop on a {report['gpu_bandwidth'] / 1e12:.1f} TB/s floor (predicted) |", "|---|---|---|---|---|"]
    for row in report["ratios"]:
        lines.append(f"| {row['batch']} | {row['context']} | {row['measured_full_over_kvpop']:.2f}x | "
                     f"{row['floor_full_over_kvpop']:.2f}x | {row['predicted_gpu_full_over_kvpop']:.2f}x |")
    lines += ["", f"Predicted on a {report['gpu_bandwidth'] / 1e12:.1f} TB/s GPU in float16 (the floor alone, not a measurement):",
              "", "| batch | context | full ms | kvpop ms | full / kvpop |", "|---|---|---|---|---|"]
    for row in report["gpu_predictions"]:
        lines.append(f"| {row['batch']} | {row['context']} | {row['full_fp16_s'] * 1e3:.3f} | {row['kvpop_fp16_s'] * 1e3:.3f} | "
                     f"{row['full_over_kvpop']:.2f}x |")
    lines += ["", "The GPU columns are a prediction from bytes alone (weights and KV at the stated bandwidth), "
              "not a measurement: a GPU step also pays kernel launches and compute, which the floor leaves out."]
    return "\n".join(lines) + "\n"


def plot(report: dict, out_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["rows"]
    labels = [f"B{row['batch']} {row['context'] // 1024}k\n{row['cache']}" for row in rows]
    x = np.arange(len(rows))
    figure, axis = plt.subplots(figsize=(max(8, 0.8 * len(rows)), 4))
    axis.bar(x - 0.2, [row["fitted_fixed_s"] * 1e3 for row in rows], 0.4, label="measured: fixed (weights)", color="#4c72b0")
    axis.bar(x - 0.2, [row["fitted_kv_s"] * 1e3 for row in rows], 0.4, bottom=[row["fitted_fixed_s"] * 1e3 for row in rows],
             label="measured: per slot (KV)", color="#dd8452")
    axis.scatter(x - 0.2, [row["median_s"] * 1e3 for row in rows], color="black", s=12, zorder=3, label="measured step")
    axis.bar(x + 0.2, [row["floor_weights_s"] * 1e3 for row in rows], 0.4, label="floor: weights / bandwidth", color="#8fa8d6")
    axis.bar(x + 0.2, [row["floor_kv_s"] * 1e3 for row in rows], 0.4, bottom=[row["floor_weights_s"] * 1e3 for row in rows],
             label="floor: KV / bandwidth", color="#f0b48a")
    axis.set_xticks(x, labels, fontsize=7)
    axis.set_ylabel("ms per decode step")
    axis.set_title(f"decode step: weights vs KV traffic ({report['machine']})", fontsize=9)
    axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(out_dir / "step_split.png", dpi=110)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvpop_eval.bench.step_split", description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help="exported model directory (python -m export)")
    parser.add_argument("--out-dir", type=Path, default=Path("build/results/step-split"))
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--rounds", type=int, default=5, help="interleaved repetitions per case (medians)")
    parser.add_argument("--threads", type=int, default=None, help="onnxruntime threads (default: every core)")
    parser.add_argument("--gpu-bandwidth", type=float, default=H100_BANDWIDTH, help="bytes/s of the predicted GPU")
    parser.add_argument("--predict-batches", type=int, nargs="+", default=[1, 8, 32, 64],
                        help="batches of the GPU prediction (the floor alone)")
    parser.add_argument("--bandwidth-mb", type=int, default=512, help="array size of the bandwidth measurement")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                        help="cuda: time the step on the GPU (its floor then uses --gpu-bandwidth, nominal)")
    args = parser.parse_args(argv)
    from kvpop.model_spec import ModelSpec

    spec = ModelSpec.load(args.model)
    if args.device == "cuda":
        bandwidth = {"read_bytes_per_s": args.gpu_bandwidth, "copy_bytes_per_s": args.gpu_bandwidth,
                     "floor_bytes_per_s": args.gpu_bandwidth, "threads": 0,
                     "array_mb": 0, "nominal": True}
    else:
        bandwidth = stream_bandwidth(args.bandwidth_mb)
    print(f"[step-split] bandwidth: read {bandwidth['read_bytes_per_s'] / 1e9:.1f} GB/s, copy "
          f"{bandwidth['copy_bytes_per_s'] / 1e9:.1f} GB/s", flush=True)
    weights = weight_bytes(args.model)
    rows = time_steps(args.model, args.batches, args.contexts, args.rounds, args.threads, args.device)
    fixed, per_slot = fit(rows)
    rows = split(rows, weights, bandwidth["floor_bytes_per_s"], fixed, per_slot, args.gpu_bandwidth, spec.kv_bytes_per_token)
    report = {
        "kind": "step-split",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs (shared), " + ("the GPU" if args.device == "cuda" else "no GPU"),
        "device": args.device,
        "load_average": os.getloadavg()[0],
        "model": str(args.model), "weight_bytes": weights, "kv_bytes_per_token": spec.kv_bytes_per_token,
        "compression": COMPRESSION, "rounds": args.rounds, "bandwidth": bandwidth, "gpu_bandwidth": args.gpu_bandwidth,
        "fit": {"fixed_s": fixed, "per_slot_s": per_slot}, "rows": rows, "ratios": ratios(rows),
        "gpu_predictions": gpu_predictions(weights, spec.kv_bytes_per_token, args.predict_batches, args.contexts, args.gpu_bandwidth),
    }
    save_report(args.out_dir, "step_split", report, markdown(report), plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
