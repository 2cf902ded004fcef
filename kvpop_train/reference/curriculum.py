"""Curriculum: stages of task distributions, advanced by measured accuracy, never by the clock.

Retrieval is the skill that forms slowly, so the first stage is dense drills of the
one circuit every lookup uses (kvpop_train.reference.drills) next to short recall questions. Chains
of facts come next at short lengths, then the benchmark lengths themselves (RoPE models do not
extrapolate, so each length is trained before it is evaluated). Later stages keep sampling the
shorter distributions so earlier skills are not forgotten.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpop_tasks import TaskConfig
from kvpop_train.reference.drills import Drill, LookupDrill, RepeatDrill


@dataclass(frozen=True)
class Stage:
    name: str
    mixture: tuple[TaskConfig | Drill, ...]  # each training batch draws one of these uniformly
    gate: TaskConfig  # validation distribution that decides when to move on
    threshold: float = 0.9  # gate accuracy (every chain-of-thought token right) needed to advance
    tokens_per_batch: int = 4096


def _chains(context_tokens: int, num_facts: int | None, questions: int, min_hops: int = 0) -> TaskConfig:
    return TaskConfig(context_tokens=context_tokens, hops=3, min_hops=min_hops, num_facts=num_facts, questions=questions)


def _benchmark(context_tokens: int) -> TaskConfig:
    return TaskConfig(context_tokens=context_tokens, hops=3)


RECALL_96 = TaskConfig(context_tokens=96, hops=0, num_facts=16, distractors=0, questions=6)
RECALL_96_DENSE = TaskConfig(context_tokens=96, hops=0, num_facts=16, distractors=0, questions=12)

# Recall questions ask far fewer questions than there are facts: when every fact was asked once,
# the model learned to answer "a context number not answered yet" instead of looking names up.
STAGES: tuple[Stage, ...] = (
    Stage(
        name="recall-96",
        mixture=(LookupDrill(num_facts=8, num_lookups=24), RepeatDrill(), RECALL_96_DENSE),
        gate=RECALL_96,
        tokens_per_batch=2048,
    ),
    Stage(
        name="chains-128",
        mixture=(LookupDrill(num_facts=16, num_lookups=32), RECALL_96, _chains(128, 16, questions=3)),
        gate=_chains(128, 16, questions=3),
        tokens_per_batch=2048,
    ),
    Stage(
        name="chains-256",
        mixture=(_chains(128, 16, questions=3), _chains(256, 24, questions=3)),
        gate=_chains(256, 24, questions=3, min_hops=3),
    ),
    Stage(
        name="benchmark-512",
        mixture=(_chains(256, 24, questions=3), _chains(512, None, questions=2, min_hops=1)),
        gate=_benchmark(512),
        tokens_per_batch=8192,
    ),
    Stage(
        name="benchmark-1024",
        mixture=(_chains(512, None, questions=2, min_hops=1), _chains(1024, None, questions=2, min_hops=1)),
        gate=_benchmark(1024),
        tokens_per_batch=8192,
    ),
    Stage(
        name="benchmark-2048",
        mixture=(_chains(1024, None, questions=2, min_hops=1), _chains(2048, None, questions=2, min_hops=1)),
        gate=_benchmark(2048),
        tokens_per_batch=8192,
    ),
)


@dataclass
class StageRecord:
    """What happened in one stage, kept in the checkpoint and the model card."""

    name: str
    start_step: int
    start_tokens: int
    start_seconds: float
    passed_step: int | None = None
    passed_tokens: int | None = None
    passed_seconds: float | None = None
    best_accuracy: float = 0.0


@dataclass
class CurriculumState:
    stage: int = 0
    records: list[StageRecord] = field(default_factory=list)

    @property
    def current(self) -> Stage:
        return STAGES[self.stage]

    @property
    def finished(self) -> bool:
        return bool(self.records) and self.records[-1].passed_step is not None and self.stage == len(STAGES) - 1

    def begin(self, step: int, tokens: int, seconds: float) -> None:
        """Open the record of the first stage (a resumed run already has it)."""
        if not self.records:
            self.records.append(StageRecord(self.current.name, step, tokens, seconds))

    def report(self, accuracy: float, step: int, tokens: int, seconds: float) -> bool:
        """Record a gate measurement; advance when it clears the threshold. True when the stage changed."""
        record = self.records[-1]
        record.best_accuracy = max(record.best_accuracy, accuracy)
        if accuracy < self.current.threshold or record.passed_step is not None:
            return False
        record.passed_step, record.passed_tokens, record.passed_seconds = step, tokens, seconds
        if self.stage + 1 < len(STAGES):
            self.stage += 1
            self.records.append(StageRecord(STAGES[self.stage].name, step, tokens, seconds))
            return True
        return False
