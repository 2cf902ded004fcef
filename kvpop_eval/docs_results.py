"""Render the committed results (docs/results/*.json) into the tables of README.md and docs/*.md.

A table lives between two markers, `<!-- results:NAME -->` and `<!-- /results -->`; NAME is a
result file of docs/results/ (its table: a quality sweep or a service benchmark) or `headline`
(README's one table of every result). The text between the markers is always rewritten, never
edited by hand, so a number in the docs is the number in its JSON file (tests/test_docs_results.py).

    python -m kvpop_eval.docs_results render            # make docs-results: rewrite the tables in place
    python -m kvpop_eval.docs_results render --check    # exit 1 when a table differs from its file
    python -m kvpop_eval.docs_results publish [NAME...] # make publish-results: build/results -> docs/results
"""
from __future__ import annotations

import argparse
import json
import math
import re
import shutil
import statistics
import sys
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO_ROOT / "docs" / "results"
BUILD_RESULTS_DIR = REPO_ROOT / "build" / "results"
MANIFEST = "manifest.json"
MARKER = re.compile(r"(<!-- results:(?P<name>[\w.-]+) -->\n)(?P<body>.*?)(<!-- /results -->)", re.DOTALL)
COMPRESSIONS = (0.5, 0.75, 0.88, 0.94)


# the service's default (query-aware where the model ships retrieval heads), its learned ranking alone, the heuristic baseline
HEADLINE_POLICIES = ("kvpop:mlstm", "kvpop:mlstm+noquery", "streaming")
# the baselines on equal footing (docs/QUALITY.md): the question's picks with a recency fill, SnapKV, H2O and TOVA on the
# whole prompt, the learned ranking alone, StreamingLLM, keep-the-start
BASELINES = ("kvpop:mlstm+recency", "snapkv", "h2o", "tova", "kvpop:mlstm+noquery", "streaming", "keep_start")


@dataclass(frozen=True)
class ResultSpec:
    """What one published result is: its source under build/results/, a title and the command that makes it."""

    name: str
    source: str  # path under build/results/, as the benchmark wrote it
    title: str
    command: str
    headline_policies: tuple[str, ...] = HEADLINE_POLICIES  # its rows in README's headline, where it has them ...
    headline_memory: bool = True  # ... and its KV memory row (off where a larger run of the same tasks shows it)


SPECS = {
    spec.name: spec
    for spec in (
        ResultSpec("diverse-test-2048", "diverse-test/analysis/headline-2048/sweep.json",
                   "SmolLM2-135M-Instruct, diverse suite (pre-registered test split), 2,048 tokens",
                   "for n in $(seq 1 24); do make eval-diverse-test DIVERSE_PIECE=$n; done",
                   headline_policies=("kvpop:mlstm",)),
        ResultSpec("diverse-test-baselines-2048", "diverse-test/analysis/baselines-2048/sweep.json",
                   "SmolLM2-135M-Instruct, diverse suite (pre-registered test split, every baseline), 2,048 tokens",
                   "for n in $(seq 1 6); do make eval-diverse-test DIVERSE_PIECE=$n; done",
                   headline_policies=BASELINES, headline_memory=False),
        ResultSpec("diverse-test-4096", "diverse-test/analysis/baselines-4096/sweep.json",
                   "SmolLM2-135M-Instruct, diverse suite (pre-registered test split), 4,096 tokens",
                   "for n in $(seq 25 30); do make eval-diverse-test DIVERSE_PIECE=$n; done",
                   headline_policies=("kvpop:mlstm", *BASELINES)),
        ResultSpec("diverse-validation-2048", "diverse-validation/sweep.json",
                   "SmolLM2-135M-Instruct, diverse suite (validation split), 2,048 tokens",
                   "make eval-diverse-validation DIVERSE_VALIDATION_POLICIES=kvpop:mlstm,kvpop:mlstm+recency@0.88,snapkv@0.88",
                   headline_policies=()),
        ResultSpec("multiturn", "multiturn/multiturn.json",
                   "SmolLM2-135M-Instruct, multi-turn chats (test split, pre-registered)",
                   "make eval-multiturn"),
        ResultSpec("quality-reference-2048", "quality-reference-2048/sweep.json",
                   "reference model, 200 held-out tasks, 2,048 tokens",
                   "make eval-sweep EVAL_POLICIES=kvpop:mlstm,streaming"),
        ResultSpec("service-reference", "service-reference/service.json",
                   "the real server vs FastAPI + HF generate, reference model, kvpop at 88%",
                   "make bench-service BENCH_ARGS='--workloads a c d --repetitions 1 --stall-tokens 0'"),
        ResultSpec("service-smollm2", "service-smollm2/service.json",
                   "SmolLM2 through the real server: the full cache, kvpop at 88% and the classic design",
                   "make bench-service-real"),
        ResultSpec("peers-smollm2", "peers-smollm2/service.json",
                   "SmolLM2 on the CPU: the real server against llama.cpp's server and ONNX Runtime GenAI", "make bench-peers"),
        ResultSpec("step-split", "step-split/step_split.json",
                   "SmolLM2's decode step: weights and KV traffic", "make bench-step-split"),
    )
}
# the quality results in README's headline, in its order (then the multi-turn chats and the service's speed)
HEADLINE_QUALITY = ("diverse-test-2048", "diverse-test-baselines-2048", "diverse-test-4096", "quality-reference-2048")
POLICY_ORDER = ("full", "kvpop:mlstm", "kvpop:mlstm+noquery", "kvpop:mlstm+recency", "kvpop:mlstm+query", "kvpop:mlp", "kvpop",
                "snapkv", "h2o", "tova", "streaming", "keep_start", "random")


# -- statistics -------------------------------------------------------------------------------------

def wilson_interval(correct: int, total: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a proportion: honest at small n and near 0 or 1, unlike p +/- 2 se."""
    if total == 0:
        return (0.0, 0.0)
    p = correct / total
    centre = (p + z * z / (2 * total)) / (1 + z * z / total)
    half = z * math.sqrt(p * (1 - p) / total + z * z / (4 * total * total)) / (1 + z * z / total)
    return (max(0.0, centre - half), min(1.0, centre + half))


def paired_counts(policy: str, full: str) -> tuple[int, int]:
    """Tasks only the policy answers, and tasks only the full cache answers (correct_by_task strings)."""
    return (sum(a == "1" and b == "0" for a, b in zip(policy, full)),
            sum(a == "0" and b == "1" for a, b in zip(policy, full)))


def ratio_and_retained(policy: str, full: str) -> dict:
    """The pre-registered statistics of a row against the full cache (kvpop_eval.quality.analysis.cell_statistics):
    the accuracy ratio with its 95% paired bootstrap interval, and the share of the full cache's answers kept."""
    import numpy as np

    from kvpop_eval.quality.analysis import cell_statistics

    correct, reference = (np.array([char == "1" for char in text]) for text in (policy, full))
    return cell_statistics(correct, reference)


# -- loading ----------------------------------------------------------------------------------------

def load_manifest(results_dir: Path) -> dict:
    path = results_dir / MANIFEST
    return json.loads(path.read_text()) if path.exists() else {}


def load_result(results_dir: Path, name: str) -> dict | None:
    path = results_dir / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def provenance(name: str, manifest: dict) -> str:
    """The line under every table: the command that reproduces it and the commit it was produced at."""
    spec = SPECS.get(name)
    commit = manifest.get(name, {}).get("commit", "unknown")
    command = f"`{spec.command}`" if spec else "(no command recorded)"
    return f"Reproduce: {command}. Produced at commit `{commit[:12]}` (`docs/results/{name}.json`)."


def missing(name: str) -> str:
    return f"*Not published yet: `make publish-results RESULTS={name}` after the run that writes `build/results/{name}/`.*\n"


# -- sweeps -----------------------------------------------------------------------------------------

def policy_rank(policy: str) -> tuple[int, str]:
    return (POLICY_ORDER.index(policy) if policy in POLICY_ORDER else len(POLICY_ORDER), policy)


def full_row(sweep: dict) -> dict:
    return next(row for row in sweep["results"] if row["policy"] == "full")


def sweep_rows(sweep: dict) -> list[dict]:
    """Bounded rows (compression > 0) ordered by policy then compression: the full cache's stand-ins at 0% go."""
    rows = [row for row in sweep["results"] if row["policy"] != "full" and row["compression"] > 0]
    return sorted(rows, key=lambda row: (policy_rank(row["policy"]), row["compression"]))


def mib(num_bytes: float) -> str:
    return f"{num_bytes / 2**20:.1f} MiB"


def accuracy_cell(row: dict, full: dict, with_interval: bool = True) -> str:
    """accuracy, its Wilson interval, the fraction of the full cache and the paired +/- against it."""
    tasks = row["tasks"]
    cell = f"{row['accuracy']:.3f}"
    if with_interval:
        low, high = wilson_interval(round(row["accuracy"] * tasks), tasks)
        cell += f" [{low:.2f}, {high:.2f}]"
    if row is not full and full["accuracy"] > 0:
        cell += f", {row['accuracy'] / full['accuracy']:.2f}x"
        if row.get("correct_by_task") and full.get("correct_by_task"):
            low, high = ratio_and_retained(row["correct_by_task"], full["correct_by_task"])["ratio_interval"]
            gained, lost = paired_counts(row["correct_by_task"], full["correct_by_task"])
            cell += f" [{low:.2f}, {high:.2f}], +{gained}/-{lost}"
    return cell


def sweep_table(name: str, sweep: dict, manifest: dict) -> str:
    full = full_row(sweep)
    registered = (f" ({sweep['tasks']} of the {sweep['tasks_registered']} the plan registered, pieces {', '.join(sweep['pieces'])}; "
                  f"registered at `{sweep['registered_at'][0][:12]}`)" if "tasks_registered" in sweep else "")
    lines = [
        f"{sweep['tasks']} tasks{registered}, `{sweep.get('scoring', 'exact')}` scoring, tasks file `{sweep.get('tasks_file', '?')}`.",
        "",
        "| policy | compression | accuracy [95% Wilson] | of full [95% paired bootstrap] | retained [95% Wilson] | +/- vs full | mean budget (slots) | peak KV / sequence |",
        "|---|---|---|---|---|---|---|---|",
    ]
    low, high = wilson_interval(round(full["accuracy"] * full["tasks"]), full["tasks"])
    lines.append(f"| full | 0% | {full['accuracy']:.3f} [{low:.2f}, {high:.2f}] | 1.00 | | | "
                 f"{full['mean_budget']:.0f} | {mib(full['max_peak_kv_bytes'])} |")
    for row in sweep_rows(sweep):
        low, high = wilson_interval(round(row["accuracy"] * row["tasks"]), row["tasks"])
        fraction = row["accuracy"] / full["accuracy"] if full["accuracy"] else float("nan")
        fraction_text, counts, interval = f"{fraction:.2f}", "", ""
        if row.get("correct_by_task") and full.get("correct_by_task"):
            gained, lost = paired_counts(row["correct_by_task"], full["correct_by_task"])
            counts = f"+{gained}/-{lost}"
            stats = ratio_and_retained(row["correct_by_task"], full["correct_by_task"])
            if stats["ratio"] is not None:
                fraction_text = f"{stats['ratio']:.2f} [{stats['ratio_interval'][0]:.2f}, {stats['ratio_interval'][1]:.2f}]"
            if stats["retained"] is not None:
                interval = f"{stats['retained']:.2f} [{stats['retained_interval'][0]:.2f}, {stats['retained_interval'][1]:.2f}]"
        peak = mib(row["max_peak_kv_bytes"]) if row.get("max_peak_kv_bytes") else ""
        budget = f"{row['mean_budget']:.0f}" if row.get("mean_budget") is not None else ""
        lines.append(f"| {row['policy']} | {row['compression']:.0%} | {row['accuracy']:.3f} [{low:.2f}, {high:.2f}] | "
                     f"{fraction_text} | {interval} | {counts} | {budget} | {peak} |")
    return "\n".join(lines) + "\n\n" + provenance(name, manifest) + "\n"


# -- multi-turn chats -------------------------------------------------------------------------------

ROUTE_LABELS = {"sessions": "sessions", "openai": "OpenAI API"}


def interval(values: list[float] | None, digits: int = 2) -> str:
    return f"[{values[0]:.{digits}f}, {values[1]:.{digits}f}]" if values else ""


def versus_cells(versus: dict | None) -> list[str]:
    """of full, retained and +/- of a row against the full cache (kvpop_eval.quality.analysis.cell_statistics)."""
    if versus is None:
        return ["1.00", "", ""]
    return [f"{versus['ratio']:.2f} {interval(versus['ratio_interval'])}" if versus["ratio"] is not None else "-",
            f"{versus['retained']:.2f} {interval(versus['retained_interval'])}" if versus["retained"] is not None else "-",
            f"+{versus['gained']}/-{versus['lost']}"]


def multiturn_table(name: str, chats: dict, manifest: dict) -> str:
    """Every route's rows over the chats each has run (a prefix of the registered ones): accuracy, the ratio to
    the full cache and the retained share with their intervals, computed by kvpop_eval.multiturn.runner."""
    registered = chats.get("preregistration")
    commits = registered["commits"] if registered else []
    lines = [
        f"{chats['tasks']} chats registered, scoring: {chats['scoring']}; tasks file `{chats['tasks_file']}` "
        f"(sha256 `{chats['tasks_sha256'][:12]}`)"
        + (f", pre-registered in `{registered['file']}` at commit `{commits[0][:12] if commits else 'unknown'}`." if registered else ".")
        + ("" if chats["all_chats_ran"] else " The run is not complete: each row names the chats it ran, the first of the "
           "registered order; ratios compare the chats both rows ran."),
        "",
        "| route | policy | compression | chats run | accuracy [95% Wilson] | of full [95% paired bootstrap] | retained [95% Wilson] "
        "| +/- vs full | budget (slots) | compression reached | mean tokens | peak KV / sequence |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for route, results in chats["routes"].items():
        for row in sorted(results["results"], key=lambda row: (policy_rank(row["policy"]), row["compression"])):
            low, high = wilson_interval(round(row["accuracy"] * row["tasks"]), row["tasks"])
            lines.append(f"| {ROUTE_LABELS.get(route, route)} | {row['policy']} | {row['compression']:.0%} | {row['tasks']} | "
                         f"{row['accuracy']:.3f} [{low:.2f}, {high:.2f}] | " + " | ".join(versus_cells(row.get("versus_full")))
                         + f" | {row['mean_budget']:.0f} | {row['compression_achieved']:.3f} | {row['mean_tokens']:.0f} | "
                         f"{mib(row['max_peak_kv_bytes'])} |")
    return "\n".join(lines) + "\n\n" + provenance(name, manifest) + "\n"


def multiturn_headline(chats: dict) -> list[str]:
    """README rows: the default's accuracy on the chats through each route, its ratio to the full cache."""
    lines = []
    for route, results in chats["routes"].items():
        full = full_row(results)
        kvpop = {row["compression"]: row for row in sweep_rows(results) if row["policy"] == "kvpop"}
        cells = []
        for compression in COMPRESSIONS:
            row = kvpop.get(compression)
            versus = row and row.get("versus_full")
            cells.append("" if not versus else f"{row['accuracy']:.3f} of {row['tasks']}, " + ", ".join(versus_cells(versus)))
        lines.append(f"| SmolLM2-135M-Instruct, multi-turn chats through {ROUTE_LABELS.get(route, route)} (pre-registered test split, "
                     f"{full['tasks']} of {chats['tasks']} chats run): accuracy of `kvpop` | {full['accuracy']:.3f} | "
                     + " | ".join(cells) + f" | `{SPECS['multiturn'].command}` |")
    return lines


# -- service benchmark ------------------------------------------------------------------------------

def service_table(name: str, service: dict, manifest: dict) -> str:
    lines = [
        f"{service.get('machine', '?')}; model `{service.get('model', '?')}`; kvpop at "
        f"{service.get('compression', 0.88):.0%} compression; {service.get('repetitions', 1)} repetition(s).",
        "",
        "| workload | clients | output tok/s full / kvpop / classic | kvpop vs full | kvpop vs classic "
        "| TTFT p50 full / kvpop (ms) | latency p99 full / kvpop / classic (s) |",
        "|---|---|---|---|---|---|---|",
    ]
    for workload in service["workloads"]:
        for clients in workload["concurrencies"]:
            cells = service["cells"][workload["name"]][str(clients)]
            ratios = service["ratios"][workload["name"]][str(clients)]
            median = {system: median_cell(cells[system]) for system in ("full", "kvpop", "classic")}
            lines.append(
                f"| ({workload['name']}) {workload['label']} | {clients} | "
                f"{median['full']['output_tokens_per_s']:.1f} / {median['kvpop']['output_tokens_per_s']:.1f} / "
                f"{median['classic']['output_tokens_per_s']:.1f} | {ratios['kvpop_over_full_tps']:.2f}x | "
                f"{ratios['kvpop_over_classic_tps']:.2f}x | {median['full']['ttft_p50_ms']:.0f} / "
                f"{median['kvpop']['ttft_p50_ms']:.0f} | {median['full']['latency_p99_ms'] / 1000:.1f} / "
                f"{median['kvpop']['latency_p99_ms'] / 1000:.1f} / {median['classic']['latency_p99_ms'] / 1000:.1f} |")
    return "\n".join(lines) + "\n\n" + provenance(name, manifest) + "\n"


def real_service_table(name: str, service: dict, manifest: dict) -> str:
    """kvpop_eval.bench.real_service: per workload, every system's medians and kvpop's ratio against it."""
    fmt = lambda value, spec=".1f": "-" if value is None else format(value, spec)  # noqa: E731
    median = lambda cells, key: statistics.median([c[key] for c in cells if c.get(key) is not None] or [math.nan])  # noqa: E731
    lines = [
        f"{service['machine']} (load average {service['load_average'][0]:.1f} at the start, {service['load_average_end'][0]:.1f} "
        f"at the end); model `{service['model']}`; kvpop at 88% compression; {service['repetitions']} interleaved "
        f"repetition(s), medians (once: {', '.join(service['once']) or 'none'}); English prompts, every request exactly "
        "its output tokens.",
        "",
        "| workload | system | req/s | output tok/s | TTFT p50 (ms) | ITL p50 / p90 (ms) | kvpop vs it: req/s, output tok/s, ITL p50 |",
        "|---|---|---|---|---|---|---|",
    ]
    for workload in service["workloads"]:
        for system in service["systems"]:
            cells = service["cells"][workload["name"]][system]
            if not cells:
                continue
            ratio = service["ratios"][workload["name"]].get(system)
            against = "" if ratio is None else (f"{fmt(ratio['rps'], '.2f')}x, {fmt(ratio['tps'], '.2f')}x, "
                                                 f"{fmt(ratio['itl_p50_shorter'], '.2f')}x shorter")
            lines.append(f"| {workload['label']} ({workload['clients']} clients) | {system} | {median(cells, 'requests_per_s'):.3f} | "
                         f"{median(cells, 'output_tokens_per_s'):.1f} | {fmt(median(cells, 'ttft_p50_ms'), '.0f')} | "
                         f"{fmt(median(cells, 'itl_p50_ms'))} / {fmt(median(cells, 'itl_p90_ms'))} | {against} |")
    return "\n".join(lines).replace("nan", "-") + "\n\n" + provenance(name, manifest) + "\n"


def step_split_table(name: str, split: dict, manifest: dict) -> str:
    """kvpop_eval.bench.step_split: the measured step, its floor and the GPU's predicted floor."""
    bandwidth = split["bandwidth"]
    lines = [
        f"{split['machine']} (load average {split['load_average']:.1f}); {split['weight_bytes'] / 1e6:.0f} MB of weights, "
        f"{split['kv_bytes_per_token'] / 1e3:.1f} kB of KV per token; measured bandwidth {bandwidth['floor_bytes_per_s'] / 1e9:.1f} GB/s; "
        f"fit: {split['fit']['fixed_s'] * 1e3:.0f} ms + {split['fit']['per_slot_s'] * 1e6:.2f} µs x batch x slots (the floor: "
        f"{split['kv_bytes_per_token'] / bandwidth['floor_bytes_per_s'] * 1e6:.2f} µs a slot); medians of "
        f"{split['rounds']} interleaved repetitions. GPU columns: the floor at {split['gpu_bandwidth'] / 1e12:.1f} TB/s, a "
        "prediction, not a measurement.",
        "",
        "| batch | context | cache (slots) | measured ms | floor ms: weights + KV | fitted ms: fixed + KV | full / kvpop measured | "
        "full / kvpop on the floor | GPU floor ms fp16 (predicted) | full / kvpop on the GPU floor (predicted) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    ratios = {(row["batch"], row["context"]): row for row in split["ratios"]}
    for row in split["rows"]:
        ratio = ratios[(row["batch"], row["context"])]
        shown = {key: f"{ratio[key]:.2f}x" if row["cache"] == "full" else ""  # once per (batch, context): on its full row
                 for key in ("measured_full_over_kvpop", "floor_full_over_kvpop", "predicted_gpu_full_over_kvpop")}
        lines.append(
            f"| {row['batch']} | {row['context']} | {row['cache']} ({row['slots']}) | {row['median_s'] * 1e3:.0f} | "
            f"{row['floor_weights_s'] * 1e3:.0f} + {row['floor_kv_s'] * 1e3:.0f} | {row['fitted_fixed_s'] * 1e3:.0f} + "
            f"{row['fitted_kv_s'] * 1e3:.0f} | {shown['measured_full_over_kvpop']} | {shown['floor_full_over_kvpop']} | "
            f"{row['predicted_gpu_fp16_s'] * 1e3:.2f} | {shown['predicted_gpu_full_over_kvpop']} |")
    lines += ["", f"Predicted on a {split['gpu_bandwidth'] / 1e12:.1f} TB/s GPU in float16, the floor alone (not a measurement):", "",
              "| batch | " + " | ".join(f"{context} tokens: full / kvpop ms" for context in sorted({r["context"] for r in split["gpu_predictions"]}))
              + " |", "|---|" + "---|" * len({r["context"] for r in split["gpu_predictions"]})]
    for batch in sorted({row["batch"] for row in split["gpu_predictions"]}):
        cells = [f"{row['full_fp16_s'] * 1e3:.2f} / {row['kvpop_fp16_s'] * 1e3:.2f} ({row['full_over_kvpop']:.2f}x)"
                 for row in split["gpu_predictions"] if row["batch"] == batch]
        lines.append(f"| {batch} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n\n" + provenance(name, manifest) + "\n"


def median_cell(repetitions: list[dict]) -> dict:
    """The repetition with the median output rate stands for the cell (one repetition: itself)."""
    return sorted(repetitions, key=lambda cell: cell["output_tokens_per_s"])[len(repetitions) // 2]


def ratio_range(service: dict, workload: str, key: str) -> str:
    values = [ratios[key] for ratios in service["ratios"][workload].values()]
    low, high = min(values), max(values)
    return f"{low:.2f}x" if f"{low:.2f}" == f"{high:.2f}" else f"{low:.2f}-{high:.2f}x"


# -- the README's headline --------------------------------------------------------------------------

def headline_table(results: dict[str, dict | None], manifest: dict) -> str:
    """One table: quality and KV memory per sequence at 50/75/88/94%, service speed, each with its command."""
    header = ["| result | full cache | 50% | 75% | 88% | 94% | reproduce |", "|---|---|---|---|---|---|---|"]
    lines = list(header)
    for name in HEADLINE_QUALITY:
        sweep = results.get(name)
        if sweep is None:
            lines.append(f"| {SPECS[name].title}: not published yet | | | | | | `{SPECS[name].command}` |")
            continue
        full = full_row(sweep)
        title = SPECS[name].title + (f", {sweep['tasks']} of {sweep['tasks_registered']} registered tasks run"
                                     if "tasks_registered" in sweep else "")  # a pre-registered plan, partly run
        by_policy: dict[str, dict[float, dict]] = {}
        for row in sweep_rows(sweep):
            by_policy.setdefault(row["policy"], {})[row["compression"]] = row
        for policy in [policy for policy in SPECS[name].headline_policies if policy in by_policy]:
            cells = [accuracy_cell(by_policy[policy][c], full) if c in by_policy[policy] else "" for c in COMPRESSIONS]
            lines.append(f"| {title}: accuracy of `{policy}` | {accuracy_cell(full, full)} | "
                         + " | ".join(cells) + f" | `{SPECS[name].command}` |")
        if not SPECS[name].headline_memory:
            continue
        kvpop = by_policy.get(next((policy for policy in HEADLINE_POLICIES if policy in by_policy), ""), {})
        memory = [mib(kvpop[c]["max_peak_kv_bytes"]) if c in kvpop else "" for c in COMPRESSIONS]
        lines.append(f"| {title}: KV memory per sequence (peak) | {mib(full['max_peak_kv_bytes'])} | "
                     + " | ".join(memory) + f" | `{SPECS[name].command}` |")
    chats = results.get("multiturn")
    if chats is not None:
        lines += multiturn_headline(chats)
    service = results.get("service-reference")
    spec = SPECS["service-reference"]
    if service is None:
        lines.append(f"| {spec.title}: not published yet | | | | | | `{spec.command}` |")
    else:
        for key, against in (("kvpop_over_full_tps", "full cache"), ("kvpop_over_classic_tps", "classic design")):
            speed = "; ".join(f"({w['name']}) {ratio_range(service, w['name'], key)}" for w in service["workloads"])
            lines.append(f"| service output tokens/s, kvpop at 88% vs the {against} (reference model) | | | | "
                         f"{speed} | | `{spec.command}` |")
    for name, systems in (("service-smollm2", ("full", "classic")), ("peers-smollm2", ("llamacpp:F32", "llamacpp:F16", "ortgenai:fp32", "ortgenai:int4"))):
        lines += real_service_headline(name, results.get(name), systems)
    shown = (*HEADLINE_QUALITY, "multiturn", "service-reference", "service-smollm2", "peers-smollm2")
    commits = sorted({manifest.get(name, {}).get("commit", "unknown")[:12] for name in shown if results.get(name)})
    legend = ("Cells: accuracy [95% Wilson interval], fraction of the full cache's accuracy [95% paired bootstrap], tasks only "
              "this policy / only the full cache answers. Service workloads: (a) 2,048-token prompts, (c) many users in a "
              "KV pool of 4 full sequences, (d) short chat prompts; ranges over 1-8 clients. SmolLM2's workloads: "
              "prefill-heavy (1,750-token prompts), long generation (384 output tokens), memory-bound (8 users, 2,048-token "
              "prompts, a KV pool of 4 full sequences), chat (100-token prompts); medians over the run's repetitions. "
              f"Produced at commit {', '.join(f'`{c}`' for c in commits) or '(none yet)'}; "
              "tables with every row: [docs/QUALITY.md](docs/QUALITY.md), [docs/PERFORMANCE.md](docs/PERFORMANCE.md).")
    return "\n".join(lines) + "\n\n" + legend + "\n"


def real_service_headline(name: str, service: dict | None, systems: tuple[str, ...]) -> list[str]:
    """README rows for a SmolLM2 service run: kvpop's output rate against each of `systems`, per workload."""
    spec = SPECS[name]
    if service is None:
        return [f"| {spec.title}: not published yet | | | | | | `{spec.command}` |"]
    rows = []
    for system in systems:
        ratios = [(workload["name"], service["ratios"][workload["name"]].get(system)) for workload in service["workloads"]]
        speed = "; ".join(f"{REAL_WORKLOAD_NAMES.get(workload, workload)} {ratio['tps']:.2f}x" for workload, ratio in ratios if ratio)
        rows.append(f"| service output tokens/s, kvpop at 88% vs {REAL_SYSTEM_NAMES.get(system, system)} (SmolLM2, real server) "
                    f"| | | | {speed} | | `{spec.command}` |")
    return rows


REAL_WORKLOAD_NAMES = {"prefill": "prefill-heavy", "longgen": "long generation", "memory": "memory-bound", "chat": "chat"}
REAL_SYSTEM_NAMES = {"full": "the full cache", "classic": "the classic design", "llamacpp:F32": "llama.cpp's server at F32",
                     "llamacpp:F16": "llama.cpp's server at F16", "ortgenai:fp32": "ONNX Runtime GenAI at fp32",
                     "ortgenai:int4": "ONNX Runtime GenAI at int4"}


# -- rendering --------------------------------------------------------------------------------------

def render_table(name: str, results_dir: Path) -> str:
    manifest = load_manifest(results_dir)
    if name == "headline":
        return headline_table({spec: load_result(results_dir, spec) for spec in SPECS}, manifest)
    result = load_result(results_dir, name)
    if result is None:
        return missing(name)
    if result.get("kind") == "real-service":
        return real_service_table(name, result, manifest)
    if result.get("kind") == "step-split":
        return step_split_table(name, result, manifest)
    if "cells" in result:
        return service_table(name, result, manifest)
    if "routes" in result:
        return multiturn_table(name, result, manifest)
    if "results" in result:
        return sweep_table(name, result, manifest)
    raise ValueError(f"docs/results/{name}.json is neither a quality sweep, multi-turn chats nor a service benchmark")


def render_text(text: str, results_dir: Path) -> str:
    """The text with every marked table re-rendered from its result file."""
    return MARKER.sub(lambda m: m.group(1) + render_table(m.group("name"), results_dir) + m.group(4), text)


def documents(root: Path = REPO_ROOT) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def render(paths: list[Path], results_dir: Path, check: bool = False) -> list[Path]:
    """Rewrite (or with `check`, only compare) every document; returns the ones whose tables differ."""
    stale = []
    for path in paths:
        text = path.read_text()
        rendered = render_text(text, results_dir)
        if rendered != text:
            stale.append(path)
            if not check:
                path.write_text(rendered)
    return stale


def publish(names: list[str], source_dir: Path, results_dir: Path) -> list[str]:
    """Copy build/results/<name>/... to docs/results/<name>.json (and its plot), recording the commit."""
    run_manifest = json.loads((source_dir / MANIFEST).read_text()) if (source_dir / MANIFEST).exists() else {}
    manifest = load_manifest(results_dir)
    published = []
    results_dir.mkdir(parents=True, exist_ok=True)
    for name in names:
        source = source_dir / SPECS[name].source
        if not source.exists():
            print(f"{name}: {source} not found, skipped", file=sys.stderr)
            continue
        result = json.loads(source.read_text())
        if result.get("complete") is False:
            print(f"{name}: {source} is an unfinished run, skipped", file=sys.stderr)
            continue
        shutil.copyfile(source, results_dir / f"{name}.json")
        plot = source.with_suffix(".png")
        if plot.exists():
            shutil.copyfile(plot, results_dir / f"{name}.png")
        commit = run_manifest.get("commit") or result.get("commit", "unknown")  # a run's manifest, else its own stamp
        manifest[name] = {"commit": commit, "source": f"build/results/{SPECS[name].source}",
                          "published": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%MZ")}
        published.append(name)
    (results_dir / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return published


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    render_parser = commands.add_parser("render", help="re-render every marked table in README.md and docs/*.md")
    render_parser.add_argument("--check", action="store_true", help="change nothing; exit 1 when a table is stale")
    publish_parser = commands.add_parser("publish", help="copy finished runs from build/results into docs/results")
    publish_parser.add_argument("names", nargs="*", help=f"results to publish, of {', '.join(SPECS)} (default: all)")
    publish_parser.add_argument("--from", dest="source", type=Path, default=BUILD_RESULTS_DIR)
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    args = parser.parse_args()
    if args.command == "publish":
        unknown = sorted(set(args.names) - set(SPECS))
        if unknown:
            parser.error(f"unknown results {unknown}; known: {', '.join(SPECS)}")
        print("published:", ", ".join(publish(args.names or list(SPECS), args.source, args.results_dir)) or "nothing")
    stale = render(documents(), args.results_dir, check=getattr(args, "check", False))
    for path in stale:
        print(f"{'stale' if getattr(args, 'check', False) else 'rendered'}: {path.relative_to(REPO_ROOT)}")
    if stale and getattr(args, "check", False):
        sys.exit(1)


if __name__ == "__main__":
    main()
