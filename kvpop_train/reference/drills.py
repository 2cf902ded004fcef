"""Dense warm-up drills in the task language, for the first curriculum stage only.

The skill that forms slowly is the long-range copy of a fact keyed on its name:
a question gives one lookup per ~10 tokens, and the model sits at chance until two
attention layers line up (a previous-token head, then a head matching names). Drills make
that circuit carry most of the loss, which is what made it form in about 5M tokens in
side-by-side runs (the training notes, docs/reference_model/TRAINING_NOTES.md at commit 4e61d25):

- lookup drill: facts back to back, then a run of lookups drawn with replacement
  (`b 12 ; k 40 ; b 12 ; ...`), loss on every retrieved value (multi-query associative recall);
- repeat drill: a random run of task words, repeated with a random period, loss on every
  repeated word (the pure induction copy).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from kvpop_tasks.generator import COPY, FORMAT, RETRIEVE
from kvpop_tasks.language import FACT_END, MAX_VALUE, NAMES, NUMBERS, OPERATORS

_SEED_BASE = 1 << 50  # drill streams never share seeds with task splits


@dataclass(frozen=True)
class LookupDrill:
    num_facts: int = 8
    num_lookups: int = 24


@dataclass(frozen=True)
class RepeatDrill:
    length: int = 96  # words after BOS
    min_period: int = 6
    max_period: int = 40


Drill = LookupDrill | RepeatDrill


def drill_words(drill: Drill, index: int) -> tuple[list[str], list[str]]:
    """Words (without BOS) and the role of each word as a target (`none`: no loss)."""
    rng = random.Random(_SEED_BASE + index)
    if isinstance(drill, LookupDrill):
        names = rng.sample(NAMES, drill.num_facts)
        values = {name: str(rng.randint(0, MAX_VALUE)) for name in names}
        words: list[str] = []
        roles: list[str] = []
        for name in names:
            words += [name, values[name], FACT_END]
            roles += ["none", "none", "none"]
        for _ in range(drill.num_lookups):
            name = rng.choice(names)
            words += [name, values[name], FACT_END]
            roles += ["none", RETRIEVE, FORMAT]
        return words, roles
    period = rng.randint(drill.min_period, drill.max_period)
    alphabet = NUMBERS + OPERATORS + NAMES
    unit = [rng.choice(alphabet) for _ in range(period)]
    words = [unit[i % period] for i in range(drill.length)]
    roles = ["none"] * period + [COPY] * (drill.length - period)
    return words, roles
