"""`make help` lists every documented target exactly once, under one of its groups."""
import re
import subprocess
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
GROUPS = ("run", "test", "evaluate", "benchmark", "deploy")


def test_make_help_lists_every_target_once_grouped():
    output = subprocess.run(["make", "-s", "help"], cwd=REPO_ROOT, capture_output=True, text=True, check=True).stdout
    documented = re.findall(r"^([a-z0-9-]+):.*## ", (REPO_ROOT / "Makefile").read_text(), flags=re.M)
    listed = re.findall(r"^  make (\S+)", output, flags=re.M)
    assert sorted(listed) == sorted(documented)
    headers = [line[:-1] for line in output.splitlines() if not line.startswith(" ")]
    assert headers == list(GROUPS)
