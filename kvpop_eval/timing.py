"""The benchmarks' one timing loop: every case once per round, rounds interleaved, medians.

Interleaving (round 1 of every case, then round 2, ...; the order reversed every other round) makes a
slow minute of a shared machine hit every case alike, where timing case after case would charge it to
whichever case ran then. The first `warmup` rounds are run and discarded.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Mapping, TypeVar

T = TypeVar("T")


def interleaved(cases: Mapping[str, Callable[[], T]], rounds: int, warmup: int = 0,
                alternate: bool = True) -> dict[str, list[tuple[float, T]]]:
    """{case: [(wall seconds, what the case returned), one per counted round]}."""
    names = list(cases)
    samples: dict[str, list[tuple[float, T]]] = {name: [] for name in names}
    for round_index in range(warmup + rounds):
        order = names if not alternate or round_index % 2 == 0 else names[::-1]
        for name in order:
            start = time.perf_counter()
            value = cases[name]()
            seconds = time.perf_counter() - start
            if round_index >= warmup:
                samples[name].append((seconds, value))
    return samples


def medians(cases: Mapping[str, Callable[[], object]], rounds: int, warmup: int = 0,
            alternate: bool = True) -> dict[str, tuple[float, list[float]]]:
    """{case: (median wall seconds, every counted round's seconds)}."""
    timed = interleaved(cases, rounds, warmup, alternate)
    return {name: (statistics.median(s for s, _ in values), [s for s, _ in values]) for name, values in timed.items()}
