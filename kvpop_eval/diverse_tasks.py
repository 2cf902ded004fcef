"""The diverse retrieval suite: facts of many kinds, paraphrased, with same-kind distractors, hidden in text of
seven styles (kvpop_eval/text_sources.py), for the real model's accuracy under eviction.

    python -m kvpop_eval.diverse_tasks write --model DIR --split validation --context-tokens 2048 --num 70 --out FILE.jsonl

A task is a document of one source's blocks with one to four facts written into it, then one question. What
varies, seeded per task (the record says which):
  source     reference, code, readme, report, chat; the test split adds the held-out legal and changelog
  family     single      one fact
             near_miss   the fact and three of its kind about other subjects, values one digit (character, day) off
             update      the same subject's value stated twice, an old one and later a new one; the new one is asked
             several     four facts of different kinds about different subjects; one is asked
             pair        two facts of different kinds, both asked (both must be in the answer)
  kind       access code (4-6 digits), room number (3), serial number (7-9), person in charge (a name), password
             (a word), booking reference (an alphanumeric code), opening date (a date)
  paraphrase each fact's sentence is one of its kind's phrasings; "gap" phrasings share no content word with
             the question (other words for the thing and the subject: "the northern entrance" for "the north gate")
  layout     inline: inside a block, between two of its sentences (or lines: a code comment, a changelog item);
             line: a block of its own between blocks
Scoring `fact` (kvpop_eval.quality.tasks_io.task_judge): every asked value in the answer and no distractor value
(a near-miss value, the old value). The prompt is the user turn (an instruction, the document, the question)
rendered by the model's chat template. Subjects, names and words are split between validation and test by a
stable hash, as the text's blocks are; no two splits share a block, a subject or a value pool.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from kvpop_eval import text_sources
from kvpop_eval.text_sources import HELD_OUT, SOURCES, SPLITS

FAMILIES = ("single", "near_miss", "update", "several", "pair")
LAYOUTS = ("inline", "line")
CONTEXT_LENGTHS = (2048, 4096)
# (word, another word for it): a subject is "the ADJ NOUN", its alias "the ADJ' NOUN'" (no word shared)
ADJECTIVES = (("north", "northern"), ("south", "southern"), ("east", "eastern"), ("west", "western"), ("main", "principal"),
              ("upper", "top"), ("lower", "bottom"), ("old", "former"), ("large", "big"), ("small", "little"),
              ("central", "middle"), ("rear", "back"))
NOUNS = (("gate", "entrance"), ("depot", "storehouse"), ("workshop", "studio"), ("office", "bureau"), ("archive", "record room"),
         ("tower", "spire"), ("harbour", "port"), ("garage", "car park"), ("clinic", "health centre"), ("library", "reading room"),
         ("kitchen", "canteen"), ("laboratory", "lab"), ("warehouse", "stockroom"), ("station", "terminal"), ("hall", "auditorium"))
_SYLLABLES = ("ka", "lo", "mi", "ren", "tav", "sul", "bri", "dor", "fen", "gal", "hos", "jun", "kel", "mar", "nol", "pra",
              "quin", "ros", "sel", "tor", "vex", "wen", "yar", "zel")
_WORDS = ("lantern", "copper", "meadow", "falcon", "marble", "thunder", "orchid", "violet", "glacier", "saddle", "pepper",
          "canyon", "willow", "beacon", "quartz", "tundra", "cobalt", "sparrow", "velvet", "summit", "cedar", "lotus", "prism",
          "ripple", "walnut", "anchor", "biscuit", "compass", "dolphin", "feather", "harvest", "juniper", "kettle", "lemon",
          "mosaic", "nutmeg", "otter", "pebble", "quiver", "raven", "saffron", "timber", "umbrella", "vortex", "wizard")
MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September", "October", "November", "December")
INSTRUCTIONS = ("Read the document below. A question about it follows.",
                "Here is a text. Afterwards I will ask you about a detail in it.",
                "Please read this carefully; I have a question about it at the end.")


def split_of(text: str) -> str:
    return SPLITS[int(hashlib.sha256(text.encode()).hexdigest()[:8], 16) % 2]


@dataclass(frozen=True)
class Subject:
    name: str  # "the north gate"
    alias: str  # "the northern entrance"


@dataclass(frozen=True)
class FactKind:
    """One kind of fact: how it is asked, how it is stated (phrasings; `gap` ones share no content word with
    the question), what its values look like and how a near-miss value is made."""

    name: str
    question: str  # {s}: the subject
    answer_as: str  # "Answer with {answer_as} only."
    phrasings: tuple[str, ...]  # {s} subject, {S} capitalised, {v} value
    gap_phrasings: tuple[str, ...]  # {a} the subject's alias, {A} capitalised
    update: str  # the later statement of a changed value
    value: Callable[[random.Random, str], str]  # (rng, split) -> a value
    near_miss: Callable[[random.Random, str, str], str]  # (rng, value, split) -> a same-kind value close to it


def _number(digits: tuple[int, int]) -> Callable[[random.Random, str], str]:
    def make(rng: random.Random, split: str) -> str:
        count = rng.randrange(digits[0], digits[1] + 1)
        return str(rng.randrange(10 ** (count - 1), 10 ** count))
    return make


def _one_digit_off(rng: random.Random, value: str, split: str) -> str:
    place = rng.randrange(1, len(value))
    digit = rng.choice([d for d in "0123456789" if d != value[place]])
    return value[:place] + digit + value[place + 1:]


def _pool(kind: str, split: str) -> tuple[str, ...]:
    if kind == "person":
        candidates = sorted({f"{(a + b).capitalize()} {(c + d + 'son').capitalize()}" for a in _SYLLABLES[:12] for b in _SYLLABLES[12:]
                             for c in _SYLLABLES[:6] for d in ("ra", "li")})
    elif kind == "word":
        candidates = list(_WORDS)
    else:
        candidates = [f"the {adjective[0]} {noun[0]}|the {adjective[1]} {noun[1]}" for adjective in ADJECTIVES for noun in NOUNS]
    return tuple(name for name in candidates if split_of(f"{kind}:{name}") == split)


def _person(rng: random.Random, split: str) -> str:
    return rng.choice(_pool("person", split))


def _other_person(rng: random.Random, value: str, split: str) -> str:
    first = value.split()[0]
    same_first = [name for name in _pool("person", split) if name.startswith(first + " ") and name != value]
    return rng.choice(same_first or [name for name in _pool("person", split) if name != value])


def _word(rng: random.Random, split: str) -> str:
    return rng.choice(_pool("word", split))


def _other_word(rng: random.Random, value: str, split: str) -> str:
    return rng.choice([word for word in _pool("word", split) if word != value and value not in word and word not in value])


_ALNUM = "ABCDEFGHJKLMNPQRSTUVWXYZ23456789"


def _code(rng: random.Random, split: str) -> str:
    return "".join(rng.choice(_ALNUM) for _ in range(3)) + "-" + "".join(rng.choice(_ALNUM) for _ in range(3))


def _one_character_off(rng: random.Random, value: str, split: str) -> str:
    place = rng.choice([0, 1, 2, 4, 5, 6])
    return value[:place] + rng.choice([c for c in _ALNUM if c != value[place]]) + value[place + 1:]


def _date(rng: random.Random, split: str) -> str:
    return f"{rng.randrange(1, 29)} {rng.choice(MONTHS)} {rng.randrange(1995, 2031)}"


def _day_off(rng: random.Random, value: str, split: str) -> str:
    day, month, year = value.split()
    if rng.random() < 0.5:
        return f"{(int(day) + rng.randrange(0, 27)) % 28 + 1} {month} {year}"
    return f"{day} {month} {int(year) + rng.choice((-2, -1, 1, 2))}"


KINDS = (
    FactKind("access code", "What is the access code for {s}?", "the code",
             ("The access code for {s} is {v}.", "{S} can be opened with the code {v}.", "To get into {s}, enter {v} at the door."),
             ("Type {v} on the keypad to open {a}.",), "The access code for {s} was changed last week; it is now {v}.",
             _number((4, 6)), _one_digit_off),
    FactKind("room number", "What is the room number of {s}?", "the number",
             ("{S} is in room {v}.", "The room number of {s} is {v}.", "Visitors find {s} in room {v}."),
             ("You will find {a} behind door {v}.",), "{S} has moved; its room number is now {v}.",
             _number((3, 3)), _one_digit_off),
    FactKind("serial number", "What is the serial number of {s}?", "the number",
             ("The serial number of {s} is {v}.", "{S} carries serial number {v}.", "Serial number {v} belongs to {s}."),
             ("Stamped on {a} are the digits {v}.",), "{S} was re-registered; its serial number is now {v}.",
             _number((7, 9)), _one_digit_off),
    FactKind("person in charge", "Who is in charge of {s}?", "the name",
             ("{v} is in charge of {s}.", "{S} is run by {v}.", "The person in charge of {s} is {v}."),
             ("Questions about {a} go to {v}, who manages it.",), "{v} has now taken charge of {s}.",
             _person, _other_person),
    FactKind("password", "What is the password for {s}?", "the word",
             ("The password for {s} is {v}.", "{S} is protected by the password {v}.", "To enter {s}, say the password {v}."),
             ("Say {v} to the guard at {a}.",), "The password for {s} has been changed to {v}.",
             _word, _other_word),
    FactKind("booking reference", "What is the booking reference for {s}?", "the reference",
             ("The booking reference for {s} is {v}.", "{S} was booked under reference {v}.", "Use reference {v} for {s}."),
             ("Quote {v} when you collect the keys to {a}.",), "{S} was booked again; the new booking reference is {v}.",
             _code, _one_character_off),
    FactKind("opening date", "On which date does {s} open?", "the date",
             ("{S} opens on {v}.", "The opening date of {s} is {v}.", "{S} will open its doors on {v}."),
             ("Doors at {a} will first swing wide on {v}.",), "The opening of {s} was moved; it now opens on {v}.",
             _date, _day_off),
)


@dataclass
class Fact:
    kind: FactKind
    subject: Subject
    value: str
    sentence: str
    gap: bool


def _state(kind: FactKind, subject: Subject, value: str, rng: random.Random, gap: bool) -> Fact:
    template = rng.choice(kind.gap_phrasings if gap else kind.phrasings)
    sentence = template.format(s=subject.name, S=subject.name[0].upper() + subject.name[1:], a=subject.alias,
                               A=subject.alias[0].upper() + subject.alias[1:], v=value)
    return Fact(kind, subject, value, sentence, gap)


def make_facts(family: str, split: str, rng: random.Random) -> tuple[list[Fact], str, list[str], list[str]]:
    """(facts in document order, question, answer values, distractor values) of one task."""
    subjects = [Subject(*entry.split("|")) for entry in rng.sample(_pool("subject", split), 5)]
    kinds = rng.sample(KINDS, 4)
    kind, subject = kinds[0], subjects[0]
    value = kind.value(rng, split)
    asked = _state(kind, subject, value, rng, gap=rng.random() < 0.4)
    question = f"{kind.question.format(s=subject.name)} Answer with {kind.answer_as} only."
    if family == "single":
        return [asked], question, [value], []
    if family == "near_miss":
        misses = []
        while len(misses) < 3:
            miss = kind.near_miss(rng, value, split)
            if miss not in misses and miss != value and miss not in value and value not in miss:
                misses.append(miss)
        others = [_state(kind, other, miss, rng, gap=False) for other, miss in zip(subjects[1:], misses)]
        facts = [asked, *others]
        rng.shuffle(facts)
        return facts, question, [value], misses
    if family == "update":
        old = kind.near_miss(rng, value, split) if rng.random() < 0.5 else kind.value(rng, split)
        while old == value or old in value or value in old:
            old = kind.value(rng, split)
        first = _state(kind, subject, old, rng, gap=False)
        later = Fact(kind, subject, value, kind.update.format(s=subject.name, S=subject.name[0].upper() + subject.name[1:], v=value), False)
        return [first, later], f"{kind.question.format(s=subject.name)} Give the current one; answer with {kind.answer_as} only.", [value], [old]
    if family == "several":
        others = [_state(other_kind, other, other_kind.value(rng, split), rng, gap=False)
                  for other_kind, other in zip(kinds[1:], subjects[1:])]
        facts = [asked, *others]
        rng.shuffle(facts)
        return facts, question, [value], []
    if family == "pair":
        second_kind, second_subject = kinds[1], subjects[1]
        second = _state(second_kind, second_subject, second_kind.value(rng, split), rng, gap=False)
        ask = (f"Two questions. {kind.question.format(s=subject.name)} And {second_kind.question.format(s=second_subject.name)[0].lower()}"
               f"{second_kind.question.format(s=second_subject.name)[1:]} Answer with {kind.answer_as} and {second_kind.answer_as} only.")
        facts = [asked, second]
        rng.shuffle(facts)
        return facts, ask, [value, second.value], []
    raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")


_SENTENCE_END = re.compile(r"(?<=[.!?]) (?=[A-Z\"(])")
LINE_PREFIX = {"code": "# ", "changelog": "  * "}  # a fact inside a block of these is a comment, a changelog item


def _write_inline(block: str, sentence: str, source: str, rng: random.Random) -> str:
    """The fact between two sentences of the block, or, where it has no sentences to split (code, tables,
    changelog entries), as a line of its own inside it (a comment, an item)."""
    parts = _SENTENCE_END.split(block)
    if len(parts) >= 2 and source not in LINE_PREFIX:
        cut = rng.randrange(1, len(parts))
        return " ".join([*parts[:cut], sentence, *parts[cut:]])
    lines = block.split("\n")
    cut = rng.randrange(1, len(lines)) if len(lines) > 1 else 1
    indent = re.match(r"\s*", lines[cut] if cut < len(lines) else lines[-1]).group(0) if source == "code" else ""
    return "\n".join([*lines[:cut], indent + LINE_PREFIX.get(source, "") + sentence, *lines[cut:]])


def generate_task(index: int, split: str, context_tokens: int, count_tokens: Callable[[str], int],
                  sources: tuple[str, ...]) -> dict:
    """Task `index` of a split: its source, family and layout cycle (every combination in turn), the rest is seeded."""
    source = sources[index % len(sources)]
    family = FAMILIES[(index // len(sources)) % len(FAMILIES)]
    layout = LAYOUTS[(index // (len(sources) * len(FAMILIES))) % len(LAYOUTS)]
    rng = random.Random(f"diverse:{split}:{context_tokens}:{index}")
    facts, question, answer, distractors = make_facts(family, split, rng)
    instruction = rng.choice(INSTRUCTIONS)
    pool = text_sources.blocks(source, split)
    budget = context_tokens - count_tokens(instruction) - count_tokens(question) - sum(count_tokens(fact.sentence) + 4 for fact in facts)
    chosen, used = [], 0
    for position in rng.sample(range(len(pool)), len(pool)):
        cost = count_tokens(pool[position]) + 2
        if used + cost <= budget:
            chosen.append(pool[position])
            used += cost
        if budget - used < 24:
            break
    hosts = sorted(rng.sample(range(len(chosen)), len(facts)))  # document order = fact order (an update comes later)
    for offset, (host, fact) in enumerate(zip(hosts, facts)):
        if layout == "inline":
            chosen[host] = _write_inline(chosen[host], fact.sentence, source, rng)
        else:
            chosen.insert(host + offset, fact.sentence)
    content = f"{instruction}\n\n" + "\n\n".join(chosen) + f"\n\n{question}"
    return {"index": index, "split": split, "source": source, "held_out": source in HELD_OUT, "family": family, "layout": layout,
            "kinds": [fact.kind.name for fact in facts], "gap": any(fact.gap for fact in facts), "facts": len(facts),
            "context_tokens": context_tokens, "content": content, "question": question,
            "answer": answer if len(answer) > 1 else answer[0], "distractors": distractors}


def write_tasks(out: Path, split: str, num: int, context_tokens: int, model: Path, sources: tuple[str, ...] | None = None,
                first: int = 0) -> list[dict]:
    """Tasks `first` .. `first + num - 1` of a split, each prompt rendered by the model's chat template."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    sources = sources or tuple(source for source in SOURCES if split == "test" or source not in HELD_OUT)
    cache: dict[str, int] = {}

    def count_tokens(text: str) -> int:
        if text not in cache:
            cache[text] = len(tokenizer(text, add_special_tokens=False).input_ids)
        return cache[text]

    records = []
    for index in range(first, first + num):
        record = generate_task(index, split, context_tokens, count_tokens, sources)
        record["prompt"] = tokenizer.apply_chat_template([{"role": "user", "content": record.pop("content")}], tokenize=False,
                                                         add_generation_prompt=True)
        records.append(record)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(record) + "\n" for record in records))
    return records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvpop_eval.diverse_tasks", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    write = commands.add_parser("write", help="write a split's tasks as JSONL")
    write.add_argument("--model", type=Path, required=True, help="Hugging Face model directory: its tokenizer and chat template")
    write.add_argument("--split", choices=SPLITS, default="validation")
    write.add_argument("--context-tokens", type=int, default=2048)
    write.add_argument("--num", type=int, default=70)
    write.add_argument("--first", type=int, default=0, help="index of the first task (a later piece of the same split)")
    write.add_argument("--sources", help=f"comma-separated, of {', '.join(SOURCES)} (default: the split's all)")
    write.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    sources = tuple(name.strip() for name in args.sources.split(",")) if args.sources else None
    records = write_tasks(args.out, args.split, args.num, args.context_tokens, args.model, sources, args.first)
    print(f"wrote {len(records)} {args.split} tasks of ~{args.context_tokens} context tokens to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
