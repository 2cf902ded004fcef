"""Run chats through a route under policies x compressions, one result row per chat appended as it ends (a
stopped run resumes where it stopped), and summarise every route's rows against the full cache.

    <out-dir>/settings.json                     what the rows were made with (a resume must match it)
    <out-dir>/rows/<route>/<policy>@<r>.jsonl   one line per chat
    <out-dir>/multiturn.json                    the summary (kvpop_eval.docs_results renders it)
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from pathlib import Path

import numpy as np

from kvpop_eval.provenance import stamp
from kvpop_eval.quality.analysis import cell_statistics

ROUTES = ("sessions", "openai")
SCORING = "the answer and no competing value of its kind in the reply"


def load_chats(tasks: Path) -> list[dict]:
    return [json.loads(line) for line in tasks.read_text().splitlines() if line.strip()]


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def rows_path(out_dir: Path, route: str, policy: str, compression: float) -> Path:
    return out_dir / "rows" / route / f"{policy}@{0.0 if policy == 'full' else compression:g}.jsonl"


def read_rows(path: Path) -> dict[int, dict]:
    return {row["index"]: row for row in map(json.loads, path.read_text().splitlines())} if path.exists() else {}


def check_settings(out_dir: Path, settings: dict) -> None:
    """Record the run's settings, or refuse to add rows made with other settings to an existing run."""
    path = out_dir / "settings.json"
    if path.exists():
        recorded = json.loads(path.read_text())
        differing = sorted(key for key in settings if recorded.get(key) != settings[key])
        if differing:
            raise ValueError(f"{out_dir} holds rows made with other {', '.join(differing)}: use another --out-dir")
    else:
        out_dir.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(settings, indent=2) + "\n")


def cells_of(policies: list[str], compressions: list[float]) -> list[tuple[str, float]]:
    """(policy, compression) of every policy at every compression, the full cache once (at 0)."""
    return [(policy, ratio) for policy in policies for ratio in ([0.0] if policy == "full" else compressions)]


def run(route: str, tasks: Path, cells: list[tuple[str, float]], out_dir: Path, reply_tokens: int, answer_tokens: int,
        model: Path, openai_url: str | None = None, chunk: int = 16) -> None:
    """Every (policy, compression) of `cells` through `route`, skipping the chats whose rows exist: `chunk` chats
    at a time under every cell in turn, so the cells' rows fill together and a stopped run leaves them even."""
    if route not in ROUTES:
        raise ValueError(f"route must be one of {ROUTES}, got {route!r}")
    chats = load_chats(tasks)
    check_settings(out_dir, {"tasks_sha256": sha256(tasks), "reply_tokens": reply_tokens, "answer_tokens": answer_tokens})
    done = {cell: set(read_rows(rows_path(out_dir, route, *cell))) for cell in cells}
    for (policy, ratio), indices in done.items():
        print(f"{route} {policy} @ {ratio:.0%}: {len(indices)} of {len(chats)} chats done", flush=True)
    if all(len(indices) == len(chats) for indices in done.values()):
        return
    with _route(route, model, openai_url, out_dir) as (run_chats, target):
        for start in range(0, len(chats), chunk):
            for policy, ratio in cells:
                left = [chat for chat in chats[start : start + chunk] if chat["index"] not in done[(policy, ratio)]]
                if not left:
                    continue
                path = rows_path(out_dir, route, policy, ratio)
                path.parent.mkdir(parents=True, exist_ok=True)
                with path.open("a") as rows:
                    label = f"{route} {policy} @ {ratio:.0%} (chats {start}-{start + len(left) - 1})"
                    run_chats(target, left, policy, ratio, reply_tokens, answer_tokens, _row_writer(rows, label, len(left)))


def _row_writer(rows, label: str, total: int):
    """Append each chat's row as it ends (flushed: a stopped run keeps it) and show progress."""
    done = 0

    def on_row(row: dict) -> None:
        nonlocal done
        rows.write(json.dumps(row) + "\n")
        rows.flush()
        done += 1
        print(f"  {label}: chat {row['index']} {'right' if row['correct'] else 'wrong'} ({done}/{total})", flush=True)

    return on_row


@contextlib.contextmanager
def _route(route: str, model: Path, openai_url: str | None, out_dir: Path):
    """The route's `run_chats` and what it runs against: an engine, or the URL of a server (one started on the
    model's repository when none is given, stopped on exit)."""
    if route == "sessions":
        from kvpop_eval.multiturn import session_route

        yield session_route.run_chats, session_route.build_session_engine(model)
        return
    from kvpop_eval.multiturn import openai_route

    if openai_url:
        yield openai_route.run_chats, openai_url.rstrip("/")
        return
    with openai_route.started_server(model.parent.parent, out_dir / "server") as url:
        yield openai_route.run_chats, url


def done_in_order(chats: list[dict], rows: dict[int, dict]) -> list[dict]:
    """The rows of the chats run so far, in the chats' order, up to the first one not yet run: what a summary
    reports is always a prefix of the registered chats, never a selection."""
    ordered = []
    for chat in chats:
        if chat["index"] not in rows:
            break
        ordered.append(rows[chat["index"]])
    return ordered


def summary_row(policy: str, compression: float, ordered: list[dict]) -> dict:
    count = len(ordered)
    return {"policy": policy, "compression": compression, "tasks": count,
            "accuracy": sum(row["correct"] for row in ordered) / count,
            "correct_by_task": "".join("1" if row["correct"] else "0" for row in ordered),
            "compression_achieved": sum(row["compression"] for row in ordered) / count,
            "mean_budget": sum(row["budget"] for row in ordered) / count,
            "max_peak_kv_bytes": max(row["peak_kv_bytes"] for row in ordered),
            "mean_tokens": sum(row["tokens_seen"] for row in ordered) / count,
            "cold_turns": sum(row.get("cold_turns", 0) for row in ordered),
            "answers": [row["generated"] for row in ordered]}


def versus_full(row: dict, full: dict) -> dict:
    """kvpop_eval.quality.analysis's statistics of a row against the full cache, on the chats both have run."""
    count = min(row["tasks"], full["tasks"])
    correct, reference = (np.array([char == "1" for char in summary["correct_by_task"][:count]]) for summary in (row, full))
    return cell_statistics(correct, reference)


def report(tasks: Path, out_dir: Path, cells: list[tuple[str, float]], extra: dict | None = None,
           routes: tuple[str, ...] | None = None) -> dict:
    """multiturn.json of `routes` (default: those with rows): each cell's summary over the chats it has run (a
    prefix of the tasks file), and its figures against the full cache. `all_chats_ran` is false while a cell misses
    chats; every row says how many it ran."""
    chats = load_chats(tasks)
    settings = json.loads((out_dir / "settings.json").read_text())
    summary = {"tasks": len(chats), "scoring": SCORING, "tasks_file": str(tasks), "tasks_sha256": sha256(tasks),
               "shape": chats[0]["shape"], "reply_tokens": settings["reply_tokens"], "answer_tokens": settings["answer_tokens"],
               **(extra or {}), "all_chats_ran": True, "routes": {}}
    for route in routes or [route for route in ROUTES if (out_dir / "rows" / route).exists()]:
        results = []
        for policy, ratio in cells:
            ordered = done_in_order(chats, read_rows(rows_path(out_dir, route, policy, ratio)))
            summary["all_chats_ran"] &= len(ordered) == len(chats)
            if ordered:
                results.append(summary_row(policy, ratio, ordered))
        full = next((row for row in results if row["policy"] == "full"), None)
        for row in results:
            if full is not None and row is not full:
                row["versus_full"] = versus_full(row, full)
        if results:
            summary["routes"][route] = {"results": results}
    summary = stamp(summary)
    (out_dir / "multiturn.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary
