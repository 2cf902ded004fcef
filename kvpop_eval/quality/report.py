"""Sweep results as tables and a plot, and several sweeps merged into one (pure Python + matplotlib)."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

from kvpop_eval.provenance import stamp


def merge_sweeps(sweep_dirs: list[Path], out_dir: Path) -> list[dict]:
    """One sweep from several run on the SAME tasks (say, the heuristics first and the learned scorers
    once trained): the first sweep's full-cache row, every other policy's rows in the given order
    (a later sweep's row replaces an earlier one), runtimes summed into the header. The kvpress rows' header
    (`kvpress_compare merge` writes it) comes along from the last sweep that has one: without it, merging a
    later press run would take the earlier kvpress rows for stale and drop them."""
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
    summary = _with_full_at_zero(rows)
    header = {key: sweeps[0][key] for key in ("tasks", "scoring", "tasks_file", "tasks_sha256")}
    header["merged_from"] = [str(folder) for folder in sweep_dirs]
    peers = [sweep["kvpress"] for sweep in sweeps if sweep.get("kvpress")]
    if peers and any(policy.startswith("kvpress:") for policy, _ in rows):
        header["kvpress"] = peers[-1]
    header = stamp(header)
    _write_sweep(out_dir, header, summary)
    return summary


def _write_sweep(out_dir: Path, header: dict, summary: list[dict]) -> None:
    """sweep.json, sweep.md and the accuracy plot of a merged or concatenated sweep."""
    compressions = tuple(sorted({row["compression"] for row in summary}))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "sweep.json").write_text(json.dumps({**header, "results": summary}, indent=2) + "\n")
    (out_dir / "sweep.md").write_text(markdown_table(summary, compressions))
    plot_sweep(summary, out_dir / "accuracy_vs_compression.png")


def _with_full_at_zero(rows: dict[tuple[str, float], dict]) -> list[dict]:
    """The rows in policy order, each policy's 0% cell the full cache's row (nothing is evicted at 0%)."""
    full = rows[("full", 0.0)]
    for policy in dict.fromkeys(policy for policy, _ in rows):  # a --skip-full sweep's rows have no 0% cell
        if (policy, 0.0) not in rows:
            rows[(policy, 0.0)] = {**full, "policy": policy, "note": "no eviction at 0%: the full cache"}
    order = list(dict.fromkeys(policy for policy, _ in rows))
    return sorted(rows.values(), key=lambda row: (order.index(row["policy"]), row["compression"]))


def concat_sweeps(sweep_dirs: list[Path], tasks_file: Path, out_dir: Path) -> list[dict]:
    """One sweep over `tasks_file` from sweeps run on its consecutive pieces, in order (a long tasks file
    run as shards, or more tasks added to a finished run): each piece must be exactly the next lines of
    the file (checked by digest). Only the cells every piece has are kept; accuracies and budgets are
    weighted by tasks, runtimes summed, per-task results concatenated, so paired counts still hold."""
    lines = Path(tasks_file).read_text().splitlines(keepends=True)
    sweeps = [json.loads((Path(folder) / "sweep.json").read_text()) for folder in sweep_dirs]
    start = 0
    for folder, piece in zip(sweep_dirs, sweeps):
        stop = start + piece["tasks"]
        digest = hashlib.sha256("".join(lines[start:stop]).encode()).hexdigest()
        if piece.get("tasks_sha256") != digest:
            raise ValueError(f"{folder}: its {piece['tasks']} tasks are not lines {start + 1}-{stop} of {tasks_file}")
        start = stop
    if start != len(lines):
        raise ValueError(f"the pieces cover {start} of the {len(lines)} tasks in {tasks_file}")
    cells = [{(row["policy"], row["compression"]): row for row in piece["results"]
              if row["compression"] or row["policy"] == "full" or row["policy"].startswith("kvpress:")}
             for piece in sweeps]  # an engine policy's 0% cell is the engine's full cache (below); kvpress's, its own
    shared = [key for key in cells[0] if all(key in piece for piece in cells[1:])]
    summary = _with_full_at_zero({key: _concat_rows([piece[key] for piece in cells]) for key in shared})
    header = stamp({"tasks": len(lines), "scoring": sweeps[0]["scoring"], "tasks_file": str(tasks_file),
                    "tasks_sha256": hashlib.sha256("".join(lines).encode()).hexdigest(),
                    "concatenated_from": [str(folder) for folder in sweep_dirs]})
    peers = [piece.get("kvpress") for piece in sweeps]
    if all(peers) and any(row["policy"].startswith("kvpress:") for row in summary):  # kvpress_compare merge's header
        versions = {(peer["kvpress_version"], peer["transformers_version"], peer["torch_version"]) for peer in peers}
        if len(versions) != 1:
            raise ValueError(f"the pieces' kvpress rows ran different versions: {sorted(versions)}")
        header["kvpress"] = {**peers[0], "tasks_file": header["tasks_file"], "tasks_sha256": header["tasks_sha256"],
                             "full_accuracy_hf": sum(peer["full_accuracy_hf"] * piece["tasks"]
                                                     for peer, piece in zip(peers, sweeps)) / len(lines)}
    _write_sweep(out_dir, header, summary)
    return summary


def _concat_rows(pieces: list[dict]) -> dict:
    """One (policy, compression) cell from its pieces' cells (same settings, disjoint tasks)."""
    for key in ("query_window", "span_pooling"):
        if len({str(piece.get(key)) for piece in pieces}) != 1:
            raise ValueError(f"{pieces[0]['policy']} at {pieces[0]['compression']:.0%} ran with different {key} in the pieces")
    tasks = sum(piece["tasks"] for piece in pieces)

    def weighted(key: str) -> float:
        return sum(piece[key] * piece["tasks"] for piece in pieces) / tasks

    row = {**pieces[0], "tasks": tasks, "accuracy": weighted("accuracy")}
    per_task = ["correct_by_task" in piece for piece in pieces]
    if any(per_task) and not all(per_task):
        raise ValueError(f"{pieces[0]['policy']} at {pieces[0]['compression']:.0%}: a piece has no per-task results")
    if all(per_task):  # a kvpress row's 0% cell (its own full cache's accuracy) has none
        row["correct_by_task"] = "".join(piece["correct_by_task"] for piece in pieces)
        row["accuracy"] = row["correct_by_task"].count("1") / tasks
    for key in ("compression_achieved", "mean_budget", "prompt_compression"):  # the last: kvpress rows only
        if all(key in piece for piece in pieces):
            row[key] = weighted(key)
    if all("max_peak_kv_bytes" in piece for piece in pieces):
        row["max_peak_kv_bytes"] = max(piece["max_peak_kv_bytes"] for piece in pieces)
    for key in ("seconds", "prefilled_whole"):
        if all(key in piece for piece in pieces):
            row[key] = sum(piece[key] for piece in pieces)
    if all("seconds" in piece and "generated_tokens_per_s" in piece for piece in pieces):  # tokens over seconds
        row["generated_tokens_per_s"] = sum(p["generated_tokens_per_s"] * p["seconds"] for p in pieces) / row["seconds"]
    return row


def summary_row(report: dict, policy: str, ratio: float) -> dict:
    keys = ("accuracy", "compression_achieved", "mean_budget", "max_peak_kv_bytes", "generated_tokens_per_s", "tasks", "seconds",
            "prefilled_whole")
    # One character per task, in task order, so any two rows can be compared task by task.
    correct = "".join("1" if row["correct"] else "0" for row in report["rows"])
    settings = {key: report[key] for key in ("query_window", "span_pooling") if key in report}  # what a kvpop row ran
    return {"policy": policy, "compression": ratio, **settings, **{key: report[key] for key in keys}, "correct_by_task": correct}


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

