"""English long-context tasks in the spirit of RULER (Hsieh et al., 2024, "RULER: What's the Real
Context Size of Your Long-Context Language Models?"), for the real model's accuracy under eviction.

    python -m kvpop_eval.english_tasks write --model DIR --split test --context-tokens 2048 --num 40 --out FILE.jsonl

Haystack: English prose from the Python language reference that ships with every CPython
(`pydoc_data.topics`, the text behind `help("topics")`): real text, installed by name, identical on
every machine. Its paragraphs are split three ways by a stable hash, so train / validation / test
never share a haystack paragraph; entity names, keys and values are drawn from per-split seeded
generators and pools split the same way, so no two splits share a task. The scorer is never trained
on these families or this haystack (its training texts: kvpop_train/scorer/english_texts.py).

Families (the needle sentences go at seeded depths between haystack paragraphs; where one of several facts
is asked, the facts go in a shuffled order, so the asked one is at any rank among them):
  passkey     one pass key; "What is the pass key?"
  multikey    6 keys with a magic number each (5 distractors); asks for one key's number
  multivalue  4 numbers for one key among 3 distractor keys; the answer must contain all 4
  vartrack    a chain of 4 assignments from a number plus a distractor chain; all 5 names are the answer
  qa          6 generated people, each with a job and a city; asks one person's city

Prose families: the same kind of facts written INSIDE haystack paragraphs (each needle goes between two
sentences of a paragraph, so no line break is near it), as in a pasted document, an e-mail or a
transcript. A cache that ranks the prompt line by line sees such a fact only as a small part of a long
paragraph:
  prose_passkey   one pass key inside a paragraph
  prose_multikey  6 keys with a magic number each, each inside a different paragraph; asks for one key's number
  prose_multi     two pass keys (a first and a second) inside paragraphs, asked together (both must be answered)

The user turn is RULER's shape: a statement of what is hidden (never the key asked for), the haystack
with the needles, then the question. A record is {"prompt", "context", "question", "answer" (a string,
or a list that must all appear), "family", "split", "context_tokens", "index"}; "prompt" is the user
turn (context, a blank line, question) rendered by the model's chat template when --model is given.
Scoring is `contains` (kvpop_eval.quality --scoring contains).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import re
import sys
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable

SPLITS = ("train", "validation", "test")
FAMILIES = ("passkey", "multikey", "multivalue", "vartrack", "qa")  # needles on lines of their own
PROSE_FAMILIES = ("prose_passkey", "prose_multikey", "prose_multi")  # needles inside paragraphs
ALL_FAMILIES = FAMILIES + PROSE_FAMILIES
CONTEXT_LENGTHS = (1024, 2048, 4096)
SPLIT_SHARES = (0.6, 0.2, 0.2)

_SYLLABLES = ("ka", "lo", "mi", "ren", "tav", "sul", "bri", "dor", "fen", "gal", "hos", "jun", "kel", "mar",
              "nol", "pra", "quin", "ros", "sel", "tor", "ul", "vex", "wen", "yar", "zel", "bo", "ci", "da")
_JOBS = ("baker", "pilot", "surgeon", "gardener", "librarian", "carpenter", "chemist", "fisher", "tailor",
         "architect", "violinist", "geologist")
_WORDS = ("apple", "river", "lantern", "copper", "meadow", "falcon", "marble", "thunder", "orchid", "harbor",
          "violet", "ember", "glacier", "saddle", "pepper", "canyon", "willow", "beacon", "quartz", "tundra",
          "maple", "cobalt", "sparrow", "velvet", "summit", "cedar", "lotus", "prism", "ripple", "walnut")


def split_of(text: str) -> str:
    """The split a haystack paragraph or a name belongs to (a stable hash: the same on every machine)."""
    fraction = int(hashlib.sha256(text.encode()).hexdigest()[:8], 16) / 16**8
    bound = 0.0
    for split, share in zip(SPLITS, SPLIT_SHARES):
        bound += share
        if fraction < bound:
            return split
    return SPLITS[-1]


@lru_cache(maxsize=1)
def haystack_paragraphs() -> dict[str, list[str]]:
    """Prose paragraphs of the Python language reference, by split (code and tables left out)."""
    from pydoc_data.topics import topics

    by_split: dict[str, list[str]] = {split: [] for split in SPLITS}
    seen = set()
    for name in sorted(topics):
        for block in re.split(r"\n\s*\n", topics[name]):
            paragraph = " ".join(block.split())
            words = paragraph.split()
            letters = sum(char.isalpha() or char.isspace() for char in paragraph) / max(len(paragraph), 1)
            if len(words) < 25 or letters < 0.9 or paragraph in seen or block.startswith((" ", "\t")):
                continue
            seen.add(paragraph)
            by_split[split_of(paragraph)].append(paragraph)
    return by_split


@lru_cache(maxsize=None)
def _pool(kind: str, split: str) -> tuple[str, ...]:
    """Names (people, cities, variables) and keys, partitioned by split like the haystack."""
    if kind == "key":
        candidates = [f"{first}-{second}" for first in _WORDS for second in _WORDS if first != second]
    elif kind == "variable":
        candidates = [a + b + c for a in "ABCDEFGHJKLMNPQRSTUVWXYZ" for b in "ABCDEFGHJKLMNPQRSTUVWXYZ" for c in "QWXZ"]
    else:  # person, city: two or three syllables
        candidates = sorted({(a + b).capitalize() for a in _SYLLABLES for b in _SYLLABLES if a != b}
                            | {(a + b + c).capitalize() for a in _SYLLABLES[:10] for b in _SYLLABLES for c in ("n", "th", "ria")})
    return tuple(name for name in candidates if split_of(f"{kind}:{name}") == split)


@dataclass
class Needles:
    sentences: list[str]
    question: str
    answer: str | list[str]


# What the prompt says first, before the haystack, as RULER's templates do ("Some special magic numbers
# are hidden within the following text. Make sure to memorize it. I will quiz you about the numbers
# afterwards."): the kind of fact to look for, never the key that will be asked. Chosen on the
# validation split at 2,048 tokens, where SmolLM2-135M's full cache answered 0 of 3 multikey tasks
# with the plain instruction and 4 of 4 with this one (pass keys: 3 of 3 either way).
TASK_STATEMENTS = {
    "passkey": "There is a pass key hidden in the text below. Memorize it; I will ask you for it afterwards.",
    "multikey": "Some special magic numbers are hidden in the text below. Memorize them; I will ask you about one of them afterwards.",
    "multivalue": "Some special magic numbers are hidden in the text below. Memorize them; I will ask you about some of them afterwards.",
    "vartrack": "Variable assignments (VAR X = ...) are hidden in the text below. Memorize them; I will ask you about them afterwards.",
    "qa": "Facts about people, their jobs and their cities are hidden in the text below. Memorize them; I will ask you about one person afterwards.",
}
TASK_STATEMENTS["prose_passkey"] = TASK_STATEMENTS["passkey"]
TASK_STATEMENTS["prose_multikey"] = TASK_STATEMENTS["multikey"]
TASK_STATEMENTS["prose_multi"] = "There are two pass keys hidden in the text below. Memorize them; I will ask you for both afterwards."
_SENTENCE_END = re.compile(r"(?<=[.!?]) (?=[A-Z\"(])")  # where a haystack paragraph's sentences meet


def _number(rng: random.Random) -> str:
    return str(rng.randrange(100000, 1000000))


def make_needles(family: str, split: str, rng: random.Random) -> Needles:
    """The needle sentences of one task, in the order they go into the haystack. Where a question asks for
    one of several facts (multikey, multivalue, qa), the facts are shuffled, so the one asked is at any rank
    among them (RULER queries a random key): were it always first, a cache that keeps early lines would
    answer without knowing the question. A chain (vartrack) keeps its order."""
    needles = _needles_in_question_order(family, split, rng)
    if family in ("multikey", "multivalue", "qa", "prose_multikey"):
        rng.shuffle(needles.sentences)
    return needles


def _needles_in_question_order(family: str, split: str, rng: random.Random) -> Needles:
    if family == "passkey":
        key = _number(rng)
        return Needles([f"The pass key is {key}. Remember it. {key} is the pass key."],
                       "What is the pass key? Answer with the number only.", key)
    if family == "multikey":
        keys = rng.sample(_pool("key", split), 6)
        values = [_number(rng) for _ in keys]
        sentences = [f"One of the special magic numbers for {key} is: {value}." for key, value in zip(keys, values)]
        return Needles(sentences, f"What is the special magic number for {keys[0]}? Answer with the number only.", values[0])
    if family == "multivalue":
        keys = rng.sample(_pool("key", split), 4)
        values = [_number(rng) for _ in range(4)]
        sentences = [f"One of the special magic numbers for {keys[0]} is: {value}." for value in values]
        sentences += [f"One of the special magic numbers for {key} is: {_number(rng)}." for key in keys[1:]]
        return Needles(sentences, f"What are all the special magic numbers for {keys[0]}? List every one of them.", values)
    if family == "vartrack":
        names = rng.sample(_pool("variable", split), 10)
        value, other = _number(rng), _number(rng)
        chain, decoy = names[:5], names[5:]
        sentences = [f"VAR {chain[0]} = {value}.", f"VAR {decoy[0]} = {other}."]
        for previous, name in zip(chain, chain[1:]):
            sentences.append(f"VAR {name} = VAR {previous}.")
        for previous, name in zip(decoy, decoy[1:]):
            sentences.append(f"VAR {name} = VAR {previous}.")
        return Needles(sentences, f"Find all variables that are assigned the value {value}. List their names.", chain)
    if family == "qa":
        people = rng.sample(_pool("person", split), 6)
        cities = rng.sample(_pool("city", split), 6)
        jobs = [rng.choice(_JOBS) for _ in people]
        sentences = [f"{person} works as a {job} in the city of {city}." for person, job, city in zip(people, jobs, cities)]
        return Needles(sentences, f"In which city does {people[0]} work? Answer with the city only.", cities[0])
    if family == "prose_passkey":
        return _needles_in_question_order("passkey", split, rng)
    if family == "prose_multikey":
        return _needles_in_question_order("multikey", split, rng)
    if family == "prose_multi":
        first, second = _number(rng), _number(rng)
        return Needles([f"The first pass key is {first}. Remember it.", f"The second pass key is {second}. Remember it."],
                       "What are the first and the second pass keys? Answer with the two numbers only.", [first, second])
    raise ValueError(f"unknown family {family!r}; expected one of {ALL_FAMILIES}")


def generate_task(
    family: str, split: str, index: int, context_tokens: int, count_tokens: Callable[[str], int]
) -> dict:
    """One task whose context (haystack + needles) holds about `context_tokens` tokens."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    rng = random.Random(f"{split}:{family}:{context_tokens}:{index}")  # str seeds are stable across runs
    needles = make_needles(family, split, rng)
    pool = haystack_paragraphs()[split]
    order = rng.sample(range(len(pool)), len(pool))
    budget = context_tokens - sum(count_tokens(sentence) for sentence in needles.sentences) - count_tokens(needles.question)
    budget -= count_tokens(TASK_STATEMENTS[family])
    paragraphs, used = [], 0
    for position in order:
        cost = _paragraph_tokens(pool[position], count_tokens)
        if used + cost > budget:
            continue
        paragraphs.append(pool[position])
        used += cost
        if budget - used < 24:
            break
    if family in PROSE_FAMILIES:
        _write_into_paragraphs(paragraphs, needles.sentences, rng)
    else:  # needles at seeded depths, in make_needles' order (a chain's assignments stay in sequence)
        depths = sorted(rng.randrange(len(paragraphs) + 1) for _ in needles.sentences)
        for offset, (depth, sentence) in enumerate(zip(depths, needles.sentences)):
            paragraphs.insert(depth + offset, sentence)
    context = f"{TASK_STATEMENTS[family]}\n\n" + "\n\n".join(paragraphs)
    return {
        "family": family, "split": split, "index": index, "context_tokens": context_tokens,
        "content": f"{context}\n\n{needles.question}",
        "context": context, "question": needles.question,  # the two parts (kvpress takes the question apart)
        "answer": needles.answer,
    }


def _write_into_paragraphs(paragraphs: list[str], sentences: list[str], rng: random.Random) -> None:
    """Each needle between two sentences of its own paragraph (a seeded one of at least two sentences),
    in order of depth: the text runs on before and after it, with no line break near."""
    hosts = [index for index, paragraph in enumerate(paragraphs) if len(_SENTENCE_END.split(paragraph)) >= 2]
    if len(hosts) < len(sentences):
        raise ValueError(f"{len(hosts)} paragraphs of two sentences or more for {len(sentences)} needles: the context is too short")
    for host, sentence in zip(sorted(rng.sample(hosts, len(sentences))), sentences):
        parts = _SENTENCE_END.split(paragraphs[host])
        cut = rng.randrange(1, len(parts))  # after at least one sentence, before at least one
        paragraphs[host] = " ".join([*parts[:cut], sentence, *parts[cut:]])


_TOKEN_COUNTS: dict[tuple[int, str], int] = {}


def _paragraph_tokens(paragraph: str, count_tokens: Callable[[str], int]) -> int:
    key = (id(count_tokens), paragraph)
    if key not in _TOKEN_COUNTS:
        _TOKEN_COUNTS[key] = count_tokens(paragraph) + 2  # the blank line between paragraphs
    return _TOKEN_COUNTS[key]


def write_tasks(
    out: Path, split: str, num: int, context_tokens: int, model: Path | None = None, families: tuple[str, ...] = FAMILIES
) -> list[dict]:
    """`num` tasks cycling through the families; prompts rendered by the model's chat template."""
    if model is not None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model)

        def count_tokens(text: str) -> int:
            return len(tokenizer(text, add_special_tokens=False).input_ids)
    else:
        tokenizer = None

        def count_tokens(text: str) -> int:
            return max(1, round(len(text) / 4))  # ~4 characters per token of English
    records = []
    for index in range(num):
        record = generate_task(families[index % len(families)], split, index, context_tokens, count_tokens)
        content = record.pop("content")
        if tokenizer is not None and tokenizer.chat_template:
            record["prompt"] = tokenizer.apply_chat_template(
                [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
            )
        else:
            record["prompt"] = content
        records.append(record)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(record) + "\n" for record in records))
    return records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvpop_eval.english_tasks", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    write = commands.add_parser("write", help="write a split's tasks as JSONL")
    write.add_argument("--model", type=Path, help="Hugging Face model directory: its tokenizer and chat template")
    write.add_argument("--split", choices=SPLITS, default="test")
    write.add_argument("--context-tokens", type=int, default=2048)
    write.add_argument("--num", type=int, default=40)
    write.add_argument("--families", default=",".join(FAMILIES), help=f"comma-separated, of {', '.join(ALL_FAMILIES)}")
    write.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    families = tuple(name.strip() for name in args.families.split(",") if name.strip())
    unknown = [name for name in families if name not in ALL_FAMILIES]
    if unknown:
        parser.error(f"unknown families {unknown}; expected some of {ALL_FAMILIES}")
    records = write_tasks(args.out, args.split, args.num, args.context_tokens, args.model, families)
    print(f"wrote {len(records)} {args.split} tasks of ~{args.context_tokens} context tokens to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
