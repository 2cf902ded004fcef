"""The speed report's figures (decode_speed.png, memory.png) and its summary tables and lines."""

from __future__ import annotations

from pathlib import Path


def plot(report: dict, out_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted({row["batch"] for row in report["decode"]})
    figure, axes = plt.subplots(1, len(batches), figsize=(6.5 * len(batches), 4.8), squeeze=False)
    for axis, batch in zip(axes[0], batches):
        for system in dict.fromkeys(row["system"] for row in report["decode"]):
            rows = sorted((row for row in report["decode"] if row["system"] == system and row["batch"] == batch), key=lambda row: row["context"])
            style = "--" if system == "hf-generate" else (":" if system == "full" else "-")
            axis.plot([r["context"] for r in rows], [r["ms_per_token"] for r in rows], style, marker="o", label=system)
        axis.set(xscale="log", yscale="log", xlabel="context tokens", ylabel="decode ms per token (median)", title=f"batch {batch}")
        axis.set_xticks([r for r in report["plan"]["contexts"]], [str(r) for r in report["plan"]["contexts"]])
        axis.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())  # only the measured contexts are labelled
        axis.grid(True, which="both", alpha=0.3)
        axis.legend(fontsize=7)
    figure.suptitle(report["model_note"], fontsize=8)
    figure.tight_layout()
    figure.savefig(out_dir / "decode_speed.png", dpi=120)
    plt.close(figure)

    if not report["memory"]:
        return
    figure, (rss, kv) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, samples in report["memory"].items():
        generated = [s["generated"] for s in samples]
        rss.plot(generated, [s["peak_rss_bytes"] / 2**20 for s in samples], marker=".", label=name)
        kv.plot(generated, [s["kv_bytes"] / 2**20 for s in samples], marker=".", label=name)
    rss.set(xlabel="generated tokens (64-token prompt, batch 1)", ylabel="peak process RSS (MiB)")
    kv.set(xlabel="generated tokens (64-token prompt, batch 1)", ylabel="KV cache (MiB)")
    rss.legend()
    kv.legend()
    figure.tight_layout()
    figure.savefig(out_dir / "memory.png", dpi=120)
    plt.close(figure)


def ratios(report: dict) -> list[dict]:
    table = []
    for row in report["decode"]:
        if row["system"] in ("full", "hf-generate"):
            continue
        same = {r["system"]: r for r in report["decode"] if r["context"] == row["context"] and r["batch"] == row["batch"]}
        entry = {"system": row["system"], "context": row["context"], "batch": row["batch"]}
        for other in ("full", "hf-generate"):
            if other in same:
                entry[f"speedup_vs_{other}"] = same[other]["step_latency_s"] / row["step_latency_s"]
        table.append(entry)
    return table


def speedup_lines(report: dict, target_context: int = 8192) -> list[str]:
    contexts = {row["context"] for row in report["decode"]}
    context = min(contexts, key=lambda c: abs(c - target_context))
    lines = []
    for entry in report["ratios"]:
        if entry["context"] == context:
            versus = ", ".join(f"{entry[key]:.2f}x vs {key[len('speedup_vs_'):]}" for key in entry if key.startswith("speedup_vs_"))
            lines.append(f"context {context}, batch {entry['batch']}: {entry['system']}: {versus}")
    return lines
