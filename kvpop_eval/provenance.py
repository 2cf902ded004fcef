"""What every result JSON records about how it was made: the commit it ran at and its command line."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Callable

REPO_ROOT = Path(__file__).resolve().parent.parent


def commit() -> str:
    """`git rev-parse HEAD`, with "-dirty" when the tree has uncommitted changes; "unknown" outside git."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, check=True).stdout.strip()

    try:
        head = git("rev-parse", "HEAD")
        return head + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def command() -> str:
    """The command line as typed: `python -m <module> <args>` for a module run."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    head = ["python", "-m", spec.name.removesuffix(".__main__")] if spec and spec.name else ["python", sys.argv[0]]
    return shlex.join([*head, *sys.argv[1:]])


def stamp(result: dict) -> dict:
    """`result` with "commit" and "command" added (existing keys kept in order)."""
    return {**result, "commit": commit(), "command": command()}


def save_report(out_dir: Path, name: str, report: dict, text: str, plot: Callable[[dict, Path], None]) -> None:
    """A benchmark's last step: `<name>.json` (stamped) and `<name>.md` (`text`) in `out_dir`, its plot drawn
    there (`plot(report, out_dir)`), the table printed."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(json.dumps(stamp(report), indent=2) + "\n")
    (out_dir / f"{name}.md").write_text(text)
    plot(report, out_dir)
    print(text)
