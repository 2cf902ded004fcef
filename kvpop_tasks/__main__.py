"""CLI: `python -m kvpop_tasks write --split test --num 200 --context-tokens 512 --out FILE.jsonl`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvpop_tasks.generator import SPLITS, TaskConfig, generate_task


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvpop_tasks", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    write = commands.add_parser("write", help="write one split as JSONL, one task per line")
    write.add_argument("--split", choices=SPLITS, required=True)
    write.add_argument("--num", type=int, default=200)
    write.add_argument("--start", type=int, default=0, help="index of the first task")
    write.add_argument("--context-tokens", type=int, default=512)
    write.add_argument("--hops", type=int, default=3)
    write.add_argument("--min-hops", type=int, default=None)
    write.add_argument("--num-facts", type=int, default=None)
    write.add_argument("--distractors", type=int, default=None)
    write.add_argument("--out", type=Path, default=None, help="output file (default: stdout)")
    args = parser.parse_args(argv)

    config = TaskConfig(
        context_tokens=args.context_tokens,
        hops=args.hops,
        min_hops=args.min_hops,
        num_facts=args.num_facts,
        distractors=args.distractors,
    )
    lines = (json.dumps(generate_task(config, args.split, i).to_json()) for i in range(args.start, args.start + args.num))
    if args.out is None:
        for line in lines:
            sys.stdout.write(line + "\n")
    else:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("".join(line + "\n" for line in lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
