"""`python -m kvpop_eval.multiturn`: write chats, run them through a route, summarise, or run the
pre-registered test (kvpop_eval.multiturn.plan)."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from kvpop_eval.multiturn import plan, runner
from kvpop_eval.multiturn.chats import SPLITS, ChatShape, make_chat


def write(out: Path, split: str, num: int, shape: ChatShape) -> list[dict]:
    chats = [make_chat(split, index, shape) for index in range(num)]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(chat) + "\n" for chat in chats))
    return chats


def names(text: str) -> list[str]:
    return [name.strip() for name in text.split(",") if name.strip()]


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
    running.add_argument("--model", type=Path, default=plan.MODEL, help="exported model directory")
    running.add_argument("--tasks", type=Path, required=True)
    running.add_argument("--policies", default=",".join(plan.TEST.policies))
    running.add_argument("--compressions", default=",".join(map(str, plan.TEST.compressions)))
    running.add_argument("--reply-tokens", type=int, default=plan.TEST.reply_tokens)
    running.add_argument("--answer-tokens", type=int, default=plan.TEST.answer_tokens)
    running.add_argument("--openai-url", default=None, help="openai route: a running server's API (make serve-bg: "
                         "http://localhost:9000); default: start one on the model's repository")
    running.add_argument("--out-dir", type=Path, required=True)
    testing = commands.add_parser("test", help="the pre-registered test run: both routes, every row (resumes)")
    testing.add_argument("--model", type=Path, default=plan.MODEL)
    testing.add_argument("--openai-url", default=None)
    testing.add_argument("--out-dir", type=Path, required=True)
    args = parser.parse_args(argv)

    if args.command == "write":
        shape = ChatShape(**{field: getattr(args, field) for field in asdict(ChatShape())})
        chats = write(args.out, args.split, args.num, shape)
        print(f"wrote {len(chats)} {args.split} chats to {args.out}")
        return 0
    if args.command == "test":
        return plan.run_test(args.model, args.out_dir, args.openai_url)
    policies, compressions = names(args.policies), [float(ratio) for ratio in names(args.compressions)]
    runner.run(args.route, args.tasks, policies, compressions, args.out_dir, args.reply_tokens, args.answer_tokens,
               args.model, args.openai_url)
    summary = runner.report(args.tasks, args.out_dir, policies, compressions)
    for route, results in summary["routes"].items():
        for row in results["results"]:
            versus = row.get("versus_full")
            figures = f", {versus['ratio']:.2f} of full, retained {versus['retained']:.2f}" if versus else ""
            print(f"{route} {row['policy']} @ {row['compression']:.0%}: {row['accuracy']:.3f} of {row['tasks']}{figures}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
