"""Long-context multi-step arithmetic tasks, deterministic by (split, index).

A task is a context of facts scattered through filler, then a question `? d :` about one
variable. A fact names the variable first and then defines it: `b 12 ;` (b is 12) or
`c b +5 ;` (c is b + 5). Answering needs the whole chain of facts from the asked variable back
to a number, and the chain of thought walks it, one line per fact:

    ? d :  d c -3 -3 ;  c b +5 +2 ;  b 12 14 ;  # 14

Each line copies a fact from the context verbatim (`d c -3`) and then writes the running
offset from the asked variable (-3, then -3 +5 = +2); the root's line writes its number and
the result (12 +2 = 14). So the model reads its own intermediate result back at every step,
every computation involves only the last few tokens, and every long-range read is the copy of
one fact keyed on its name: after writing `c` the model continues the one place in the
context where `c` opened a fact. The name is the query token on purpose: small models learn
that copy within a few million tokens, while a separator between name and value (`c = ...`),
or the name after its value (`12 = b`), kept them at chance for tens of millions (measured;
models/reference/MODEL_CARD.md).
Eviction matters because the needed facts sit anywhere in the context, while distractors
(other chains, and "near-miss" facts that use a chain variable on their right-hand side)
defeat any lookup that is not keyed on the defined name.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field

from kvpop_tasks.language import (
    ANSWER_START,
    FACT_END,
    FILLER_WORDS,
    FINAL,
    MAX_HOPS,
    MAX_VALUE,
    NAMES,
    OPERATORS,
    QUESTION,
    SENTENCE_END,
    apply_operator,
    offset_word,
)

# `test` is a development split: the scorer's design was measured on it (docs/QUALITY.md).
# `heldout` is the quality headline's test split, added after that design was frozen and run once;
# nothing may be tuned on it. A split's position fixes its seeds, so new splits only ever go last.
SPLITS: tuple[str, ...] = ("train", "validation", "test", "heldout")
_SPLIT_STRIDE = 1 << 40  # seeds of different splits never overlap: split k owns [k * stride, (k+1) * stride)

# Roles of chain-of-thought tokens, for diagnostics: which skill predicting the token needs.
RETRIEVE = "retrieve"  # read from a fact in the context (the long-range lookup)
COPY = "copy"  # read back from the question or the chain of thought itself
COMPUTE = "compute"  # arithmetic on recent tokens of the chain of thought
FORMAT = "format"  # fixed by the answer grammar

QUESTION_TOKENS = 3  # "? name :"
BOS_TOKENS = 1


@dataclass(frozen=True)
class TaskConfig:
    """Knobs of one task distribution (context_tokens counts the whole prompt, BOS included)."""

    context_tokens: int = 512  # prompt length in tokens; the benchmark uses 512..4096
    hops: int = 3  # relation steps between the asked variable and its numeric root
    min_hops: int | None = None  # when set, each question draws its hops from [min_hops, hops]
    num_facts: int | None = None  # facts in the context (one per variable); None: scales with length
    distractors: int | None = None  # near-miss facts built on chain variables; None: num_facts // 4
    questions: int = 1  # questions per sequence; more than one only for dense training
    name_pool: int = len(NAMES)  # names are drawn from the first name_pool names; small pools ease early training

    def __post_init__(self) -> None:
        if not 0 <= self.hops <= MAX_HOPS or (self.min_hops is not None and not 0 <= self.min_hops <= self.hops):
            raise ValueError(
                f"need 0 <= min_hops <= hops <= {MAX_HOPS}, got min_hops={self.min_hops} hops={self.hops}"
            )
        if self.questions < 1:
            raise ValueError(f"questions must be >= 1, got {self.questions}")
        chain_facts = self.questions * (self.hops + 1)
        if not chain_facts + self.near_miss_facts <= self.fact_count <= self.name_pool <= len(NAMES):
            raise ValueError(
                f"num_facts={self.fact_count} must lie in [{chain_facts + self.near_miss_facts}, "
                f"name_pool={self.name_pool} <= {len(NAMES)}]: "
                f"{self.questions} question chain(s) of {self.hops + 1} facts plus {self.near_miss_facts} near-miss facts"
            )
        needed = BOS_TOKENS + 4 * self.fact_count + QUESTION_TOKENS
        if self.context_tokens < needed:
            raise ValueError(f"context_tokens={self.context_tokens} cannot hold {self.fact_count} facts (needs {needed})")

    @property
    def fact_count(self) -> int:
        if self.num_facts is not None:
            return self.num_facts
        chain_facts = self.questions * (self.hops + 1)
        return min(self.name_pool - 4, max(chain_facts + 2, self.context_tokens // 12))

    @property
    def near_miss_facts(self) -> int:
        return self.distractors if self.distractors is not None else self.fact_count // 4


@dataclass(frozen=True)
class Fact:
    """`name` is defined as a number (root) or as `parent <operator>`; written name first."""

    name: str
    value: int
    parent: str | None = None
    operator: str | None = None

    @property
    def words(self) -> tuple[str, ...]:
        if self.parent is None:
            return (self.name, str(self.value), FACT_END)
        return (self.name, self.parent, self.operator, FACT_END)


@dataclass(frozen=True)
class Question:
    name: str
    hops: int
    answer: int
    reasoning: tuple[str, ...]  # chain-of-thought words, ending with "# <answer>"
    roles: tuple[str, ...]  # one role per reasoning word
    fact_positions: tuple[int, ...]  # prompt positions (BOS = 0) of the defined names this answer needs


@dataclass(frozen=True)
class Task:
    config: TaskConfig
    split: str
    index: int
    context: tuple[str, ...]  # facts and filler, without BOS and question
    questions: tuple[Question, ...]
    facts: dict[str, Fact] = field(default_factory=dict, repr=False, compare=False)  # every defined name
    positions: dict[str, int] = field(default_factory=dict, repr=False, compare=False)  # name -> prompt position

    def question_about(self, name: str) -> Question | None:
        """The question (with its chain of thought) about any defined name, not only the asked ones;
        None where the chain is longer than MAX_HOPS (its running offset has no token)."""
        chain = [self.facts[name]]
        while chain[-1].parent is not None:
            chain.append(self.facts[chain[-1].parent])
        if len(chain) - 1 > MAX_HOPS:
            return None
        return _question(chain[::-1], self.positions)

    @property
    def prompt(self) -> str:
        """Context and first question; the tokenizer adds BOS."""
        return " ".join(self.context + question_words(self.questions[0].name))

    @property
    def target(self) -> str:
        return " ".join(self.questions[0].reasoning)

    @property
    def answer(self) -> str:
        return str(self.questions[0].answer)

    def to_json(self) -> dict:
        """One JSONL record: what an evaluator needs, plus metadata."""
        first = self.questions[0]
        return {
            "prompt": self.prompt,
            "answer": self.answer,
            "target": self.target,
            "split": self.split,
            "index": self.index,
            "hops": first.hops,
            "prompt_tokens": BOS_TOKENS + len(self.context) + QUESTION_TOKENS,
            "target_tokens": len(first.reasoning),
            "fact_positions": list(first.fact_positions),
            "config": asdict(self.config),
        }


def question_words(name: str) -> tuple[str, ...]:
    return (QUESTION, name, ANSWER_START)


def task_seed(split: str, index: int) -> int:
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    if not 0 <= index < _SPLIT_STRIDE:
        raise ValueError(f"index must lie in [0, 2**40), got {index}")
    return SPLITS.index(split) * _SPLIT_STRIDE + index


def generate_task(config: TaskConfig, split: str, index: int) -> Task:
    rng = random.Random(task_seed(split, index))
    names = iter(rng.sample(NAMES[: config.name_pool], config.fact_count))
    min_hops = config.hops if config.min_hops is None else config.min_hops

    chains: list[list[Fact]] = []  # root first
    for _ in range(config.questions):
        chain = [Fact(next(names), rng.randint(0, MAX_VALUE))]
        for _ in range(rng.randint(min_hops, config.hops)):
            chain.append(_relation(rng, next(names), chain[-1]))
        chains.append(chain)
    chain_facts = [fact for chain in chains for fact in chain]

    distractors: list[Fact] = []
    for _ in range(config.near_miss_facts):
        distractors.append(_relation(rng, next(names), rng.choice(chain_facts)))
    for name in names:  # the rest: independent roots and chains
        if distractors and rng.random() < 0.6:
            distractors.append(_relation(rng, name, rng.choice(distractors)))
        else:
            distractors.append(Fact(name, rng.randint(0, MAX_VALUE)))

    facts = chain_facts + distractors
    rng.shuffle(facts)
    context, positions = _lay_out(rng, facts, config.context_tokens)
    questions = tuple(_question(chain, positions) for chain in chains)
    return Task(config, split, index, tuple(context), questions, {fact.name: fact for fact in facts}, positions)


def generate_split(config: TaskConfig, split: str, num: int, start: int = 0) -> list[Task]:
    return [generate_task(config, split, index) for index in range(start, start + num)]


def _relation(rng: random.Random, name: str, parent: Fact) -> Fact:
    operator = rng.choice([op for op in OPERATORS if 0 <= apply_operator(parent.value, op) <= MAX_VALUE])
    return Fact(name, apply_operator(parent.value, operator), parent.name, operator)


def _lay_out(rng: random.Random, facts: list[Fact], context_tokens: int) -> tuple[list[str], dict[str, int]]:
    """Scatter facts through filler so the prompt has exactly context_tokens tokens.

    Returns the context words and, per defined name, its prompt position (BOS = 0).
    """
    fact_words = sum(len(fact.words) for fact in facts)
    filler = context_tokens - BOS_TOKENS - QUESTION_TOKENS - fact_words
    cuts = sorted(rng.sample(range(filler + len(facts)), len(facts)))  # stars and bars: uniform gaps
    gaps = [cut - i - (cuts[i - 1] - (i - 1) if i else 0) for i, cut in enumerate(cuts)]
    gaps.append(filler - sum(gaps))
    words: list[str] = []
    positions: dict[str, int] = {}
    for gap, fact in zip(gaps, facts + [None]):
        words.extend(_filler(rng, gap))
        if fact is not None:
            positions[fact.name] = BOS_TOKENS + len(words)  # the defined name opens its fact
            words.extend(fact.words)
    return words, positions


def _filler(rng: random.Random, count: int) -> list[str]:
    return [SENTENCE_END if rng.random() < 0.15 else rng.choice(FILLER_WORDS) for _ in range(count)]


def _question(chain: list[Fact], positions: dict[str, int]) -> Question:
    """Chain of thought: one line per fact from the asked name to the root, then `# answer`."""
    words: list[str] = []
    roles: list[str] = []

    def emit(word: str, role: str) -> None:
        words.append(word)
        roles.append(role)

    offset = 0  # asked value = root value + offset of the facts looked up so far
    for fact in reversed(chain):
        emit(fact.name, COPY)  # the asked name, or the parent named by the previous line
        if fact.parent is None:
            emit(str(fact.value), RETRIEVE)
            emit(str(fact.value + offset), COMPUTE)
        else:
            emit(fact.parent, RETRIEVE)
            emit(fact.operator, RETRIEVE)
            offset += int(fact.operator)
            emit(offset_word(offset), COMPUTE)
        emit(FACT_END, FORMAT)
    emit(FINAL, FORMAT)
    emit(str(chain[-1].value), COPY)
    return Question(
        name=chain[-1].name,
        hops=len(chain) - 1,
        answer=chain[-1].value,
        reasoning=tuple(words),
        roles=tuple(roles),
        fact_positions=tuple(sorted(positions[fact.name] for fact in chain)),
    )
