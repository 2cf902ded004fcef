"""`python -m kvpop_eval.bench.engine {steady,profile,overhead} ARGS`: runs that benchmark's main on ARGS."""

from __future__ import annotations

import importlib
import sys

from kvpop_eval.bench import engine

BENCHMARKS = ("steady", "profile", "overhead")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in BENCHMARKS:
        print(engine.__doc__, file=sys.stderr)
        return 2
    return importlib.import_module(f"kvpop_eval.bench.engine.{argv[0]}").main(argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())
