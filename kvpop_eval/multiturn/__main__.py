"""`python -m kvpop_eval.multiturn`: write chats, run them through a route, or run (and summarise) the
pre-registered test plan (kvpop_eval.multiturn.plan)."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from kvpop_eval.multiturn import plan, runner
from kvpop_eval.multiturn.chats import SPLITS, ChatShape


def names(text: str) -> list[str]:
    return [name.strip() for name in text.split(",") if name.strip()]


def print_summary(summary: dict) -> None:
    for route, results in summary["routes"].items():
        for row in results["results"]:
            versus = row.get("versus_full")
            figures = ""
            if versus and versus["ratio"] is not None:
                low, high = versus["ratio_interval"]
                figures = f", {versus['ratio']:.2f} [{low:.2f}, {high:.2f}] of full, retained {versus['retained']:.2f}"
            print(f"{route} {row['policy']} @ {row['compression']:.0%}: {row['accuracy']:.3f} of {row['tasks']} chats{figures}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvpop_eval.multiturn", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    writer = commands.add_parser("write", help="write a split's chats as JSONL")
    writer.add_argument("--split", choices=SPLITS, default="validation")
    writer.add_argument("--num", type=int, default=48)
    for field, default in asdict(ChatShape()).items():
        writer.add_argument(f"--{field.replace('_', '-')}", type=int, default=default)
    writer.add_argument("--out", type=Path, required=True)
    running = commands.add_parser("run", help="every policy x compression on the chats, through one route (resumes)")
    running.add_argument("--route", choices=runner.ROUTES, required=True)
    running.add_argument("--model", type=Path, default=Path("model_repository/kvpop_engine/1"), help="exported model directory")
    running.add_argument("--tasks", type=Path, required=True)
    running.add_argument("--policies", default="full,kvpop,keep_start")
    running.add_argument("--compressions", default="0.88,0.94")
    running.add_argument("--reply-tokens", type=int, default=32)
    running.add_argument("--answer-tokens", type=int, default=24)
    running.add_argument("--openai-url", default=None, help="openai route: a running server's API (make serve-bg: "
                         "http://localhost:9000); default: start one on the model's repository")
    running.add_argument("--out-dir", type=Path, required=True)
    for name, text in (("test", "run the registered plan's steps in order (resumes), then summarise"),
                       ("summary", "summarise the plan's chats run so far")):
        command = commands.add_parser(name, help=text)
        command.add_argument("--plan", type=Path, default=plan.PLAN)
        if name == "test":
            command.add_argument("--openai-url", default=None)
    args = parser.parse_args(argv)

    if args.command == "write":
        shape = ChatShape(**{field: getattr(args, field) for field in asdict(ChatShape())})
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(plan.chats_text(args.split, args.num, shape))
        print(f"wrote {args.num} {args.split} chats to {args.out}")
        return 0
    if args.command in ("test", "summary"):
        registered = plan.load_plan(args.plan)
        code = plan.run_test(registered, args.openai_url) if args.command == "test" else 0
        summary = plan.summarise(registered)
        print_summary(summary)
        print(json.dumps({"all_chats_ran": summary["all_chats_ran"], "out": registered["results"]}))
        return code
    cells = runner.cells_of(names(args.policies), [float(ratio) for ratio in names(args.compressions)])
    runner.run(args.route, args.tasks, cells, args.out_dir, args.reply_tokens, args.answer_tokens, args.model, args.openai_url)
    print_summary(runner.report(args.tasks, args.out_dir, cells, routes=(args.route,)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
