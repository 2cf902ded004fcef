"""Session benchmark (a program, not a test): time to first token per turn of a 10-turn conversation,
with a session (the server keeps the cache between turns and prefills only the new tokens) vs
without (the whole history is sent and prefilled every turn).

    python -m kvpop_eval.bench.sessions --model build/reference-export --out-dir build/results/sessions   # make bench-sessions

Starts the real server (kvpop.serving.process.launcher.TritonServer, CPU config) on the exported model and
streams over gRPC; TTFT is the time from sending the request to the first streamed token. The
conversation: a --system-tokens first turn (a system prompt), then --user-tokens per user turn and
--reply-tokens per answer (EOS ignored, greedy, policy `full`, so both runs see the same history).
Turns are interleaved (turn t with the session, then turn t resending the history), and so are the
repetitions (each one a new session id, the order of the two runs alternating), so a slow moment of
a shared machine hits both alike. Medians over repetitions. Writes session_ttft.json, .md, .png.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from kvpop_eval.provenance import save_report

REPO_ROOT = Path(__file__).resolve().parents[2]
MODES = ("session", "whole history")


def streamed_turn(client, prompt: list[int], reply: int, session_id: str | None) -> dict:
    options = {"eviction_policy": "full", "ignore_eos": True}
    if session_id is not None:
        options["session_id"] = session_id
    start = time.perf_counter()
    first = None
    tokens: list[int] = []
    result = None
    for chunk in client.stream(prompt, reply, **options):
        if chunk.token_ids and first is None:
            first = time.perf_counter() - start
        tokens.extend(chunk.token_ids)
        if chunk.result is not None:
            result = chunk.result
    return {"ttft_s": first, "output_ids": tokens, "prompt_tokens": len(prompt),
            "tokens_reused": result.tokens_reused if result else None,
            "tokens_computed": result.tokens_computed if result else None}


def user_turns(turns: int, system_tokens: int, user_tokens: int, vocab: int, seed: int = 7) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, system_tokens if turn == 0 else user_tokens).tolist() for turn in range(turns)]


def run(url: str, turns: list[list[int]], reply: int, reps: int) -> list[dict]:
    from kvpop_client import KVpopClient

    rows = []
    with KVpopClient(url, protocol="grpc", timeout=600) as client:
        streamed_turn(client, turns[0], 4, None)  # warm-up (first-run allocations, graph setup)
        for rep in range(reps):
            session_id = f"bench-{os.getpid()}-{rep}"
            history: list[int] = []
            order = MODES if rep % 2 == 0 else MODES[::-1]
            for turn, user in enumerate(turns):
                prompt = history + user
                outputs = {}
                for mode in order:
                    cell = streamed_turn(client, prompt, reply, session_id if mode == "session" else None)
                    outputs[mode] = cell.pop("output_ids")
                    rows.append({"rep": rep, "turn": turn + 1, "mode": mode, **cell})
                same = outputs["session"] == outputs["whole history"]
                rows[-1]["same_tokens"] = rows[-2]["same_tokens"] = same
                history = prompt + outputs["whole history"]
            print(f"rep {rep + 1}/{reps}: " + ", ".join(
                f"t{row['turn']} {row['mode'][:4]} {1000 * row['ttft_s']:.1f}ms" for row in rows if row["rep"] == rep), flush=True)
    return rows


def summarize(rows: list[dict], turns: int) -> list[dict]:
    table = []
    for turn in range(1, turns + 1):
        entry = {"turn": turn}
        for mode in MODES:
            cells = [row for row in rows if row["turn"] == turn and row["mode"] == mode]
            key = "session" if mode == "session" else "whole"
            entry[f"{key}_ttft_ms"] = 1000 * statistics.median(cell["ttft_s"] for cell in cells)
            entry[f"{key}_computed"] = int(statistics.median(cell["tokens_computed"] for cell in cells))
            entry["prompt_tokens"] = cells[0]["prompt_tokens"]
            if mode == "session":
                entry["session_reused"] = int(statistics.median(cell["tokens_reused"] for cell in cells))
        entry["same_tokens"] = all(row["same_tokens"] for row in rows if row["turn"] == turn)
        table.append(entry)
    return table


def markdown(report: dict) -> str:
    setup = report["setup"]
    lines = [
        "# Time to first token per turn: sessions vs resending the whole history",
        "",
        f"`make bench-sessions` (`kvpop_eval/bench/sessions.py`), model `{setup['model']}`, CPU config, gRPC streaming, "
        f"policy `full`, greedy; first turn {setup['system_tokens']} tokens, then {setup['user_tokens']} user tokens "
        f"and {setup['reply_tokens']} reply tokens per turn; median of {setup['reps']} interleaved repetitions; "
        f"{setup['machine']}.",
        "",
        "| turn | prompt tokens | session: reused / computed | TTFT session (ms) | TTFT whole history (ms) | whole / session | same tokens |",
        "|---:|---:|---:|---:|---:|---:|:--:|",
    ]
    for row in report["turns"]:
        lines.append(
            f"| {row['turn']} | {row['prompt_tokens']} | {row['session_reused']} / {row['session_computed']} | "
            f"{row['session_ttft_ms']:.1f} | {row['whole_ttft_ms']:.1f} | {row['whole_ttft_ms'] / row['session_ttft_ms']:.1f}x | "
            f"{'yes' if row['same_tokens'] else 'NO'} |")
    first, last = report["turns"][1], report["turns"][-1]
    lines += ["", f"From turn 2 to turn {last['turn']} the prompt grows from {first['prompt_tokens']} to "
              f"{last['prompt_tokens']} tokens; TTFT with the session goes from {first['session_ttft_ms']:.1f} to "
              f"{last['session_ttft_ms']:.1f} ms, resending the whole history from {first['whole_ttft_ms']:.1f} to "
              f"{last['whole_ttft_ms']:.1f} ms.", ""]
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    turns = [row["turn"] for row in report["turns"]]
    figure, axis = plt.subplots(figsize=(7, 4))
    for mode, key, marker in (("session", "session", "o"), ("whole history resent", "whole", "s")):
        axis.plot(turns, [row[f"{key}_ttft_ms"] for row in report["turns"]], marker=marker, label=mode)
        for rep_cells in [[c for c in report["rows"] if c["rep"] == rep and c["mode"].startswith(mode[:5])]
                          for rep in range(report["setup"]["reps"])]:
            axis.scatter([c["turn"] for c in rep_cells], [1000 * c["ttft_s"] for c in rep_cells], s=6, alpha=0.3,
                         color=axis.lines[-1].get_color())
    twin = axis.twinx()
    twin.bar(turns, [row["prompt_tokens"] for row in report["turns"]], alpha=0.12, color="gray")
    twin.set_ylabel("prompt tokens (bars)")
    axis.set_zorder(twin.get_zorder() + 1)
    axis.patch.set_visible(False)
    axis.set_xlabel("turn")
    axis.set_ylabel("time to first token (ms, median; dots: repetitions)")
    axis.set_ylim(bottom=0)
    axis.set_xticks(turns)
    axis.set_title(f"TTFT per turn, {report['setup']['model']} (CPU)")
    axis.legend(loc="upper left")
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=REPO_ROOT / "build" / "reference-export", help="an exported model")
    parser.add_argument("--out-dir", type=Path, default=REPO_ROOT / "build" / "results" / "sessions")
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--reps", type=int, default=11)
    parser.add_argument("--system-tokens", type=int, default=512)
    parser.add_argument("--user-tokens", type=int, default=64)
    parser.add_argument("--reply-tokens", type=int, default=32)
    args = parser.parse_args(argv)

    from export.repository import assemble_model_repository
    from kvpop.serving.process.tritonserver import TritonServer, free_port

    spec = json.loads((args.model / "model_spec.json").read_text())
    turns = user_turns(args.turns, args.system_tokens, args.user_tokens, spec["vocab_size"])
    with tempfile.TemporaryDirectory(prefix="kvpop-session-bench-") as scratch:
        root = assemble_model_repository(Path(scratch) / "models", args.model)
        server = TritonServer(model_repository=root, http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(),
                              address="127.0.0.1", model_config_name="cpu", log_file=Path(scratch) / "triton.log")
        with server:
            rows = run(server.grpc_url, turns, args.reply_tokens, args.reps)

    model_name = args.model.resolve().name
    report = {
        "setup": {"model": model_name, "turns": args.turns, "reps": args.reps, "system_tokens": args.system_tokens,
                  "user_tokens": args.user_tokens, "reply_tokens": args.reply_tokens,
                  "machine": f"{platform.machine()}, {os.cpu_count()} CPUs (shared)", "policy": "full"},
        "turns": summarize(rows, args.turns),
        "rows": rows,
    }
    save_report(args.out_dir, "session_ttft", report, markdown(report),
                lambda report, out_dir: plot(report, out_dir / "session_ttft.png"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
