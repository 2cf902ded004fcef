"""Tests observe the engine through its public API (state(), sequence(), results), never its private
attributes: a test that reads `engine._running` would pin the engine's internals in place."""

from __future__ import annotations

import re
from pathlib import Path

TESTS = Path(__file__).resolve().parent
PRIVATE = re.compile(r"\b(engine|warm|cold|whole|evicting|per_sequence|vectorised)\._[a-z]\w*|\._(running|prefilling|waiting|finished)\b")


def test_no_test_reads_a_private_attribute_of_the_engine():
    hits = [f"{path.relative_to(TESTS)}:{number}: {line.strip()}"
            for path in sorted(TESTS.rglob("*.py")) if path != Path(__file__).resolve()
            for number, line in enumerate(path.read_text().splitlines(), 1) if PRIVATE.search(line)]
    assert hits == []
