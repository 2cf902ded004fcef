"""The closed vocabulary of the task language.

Every word of a task is one whitespace-separated token of a fixed, small vocabulary, so one
prompt token is one model token: 512 tokens hold dozens of facts, context lengths are exact,
and a word-level tokenizer covers the language without merges. Numbers 0..99 are single
tokens (no carries to learn: adding a small constant is a lookup), relation operators carry
their constant (`+7`), running offsets of the chain of thought are signed tokens up to
+-MAX_OFFSET (`+12`, `-3`, `+0`), and variable names are single letters.
"""

from __future__ import annotations

MAX_VALUE = 99  # every value in a task lies in 0..MAX_VALUE
MAX_STEP = 9  # relation constants lie in 1..MAX_STEP
MAX_HOPS = 6  # longest chain a task may ask for
MAX_OFFSET = MAX_STEP * MAX_HOPS  # running offsets of the chain of thought lie in -MAX_OFFSET..+MAX_OFFSET

NUMBERS: tuple[str, ...] = tuple(str(n) for n in range(MAX_VALUE + 1))
OPERATORS: tuple[str, ...] = tuple(f"+{k}" for k in range(1, MAX_STEP + 1)) + tuple(
    f"-{k}" for k in range(1, MAX_STEP + 1)
)
# Running offsets: the operators plus the wider sums, and "+0" for offsets that cancel.
OFFSETS: tuple[str, ...] = ("+0",) + tuple(
    f"{sign}{k}" for sign in "+-" for k in range(MAX_STEP + 1, MAX_OFFSET + 1)
)
NAMES: tuple[str, ...] = tuple("abcdefghijklmnopqrstuvwxyz") + tuple("ABCDEFGHIJKLMNOPQRSTUVWXYZ")

FACT_END = ";"  # ends a fact in the context and a step of the chain of thought
QUESTION = "?"
ANSWER_START = ":"  # ends the question; the chain of thought follows
FINAL = "#"  # precedes the final answer
SENTENCE_END = "."  # ends a filler sentence

PUNCTUATION: tuple[str, ...] = (FACT_END, QUESTION, ANSWER_START, FINAL, SENTENCE_END)

# Filler words: never a name, number or operator, so filler can never be read as a fact.
FILLER_WORDS: tuple[str, ...] = (
    "the", "farmer", "market", "sold", "bought", "some", "apples", "pears", "boxes", "baskets",
    "each", "day", "morning", "evening", "train", "left", "station", "with", "from", "into",
    "after", "before", "many", "few", "red", "blue", "green", "old", "new", "small", "large",
    "shop", "town", "river", "road", "counted", "carried", "shared", "friends", "school", "books",
    "pens", "then", "later", "again", "also", "and", "but", "while", "near",
)  # fmt: skip

WORDS: tuple[str, ...] = NUMBERS + OPERATORS + OFFSETS + NAMES + PUNCTUATION + FILLER_WORDS


def apply_operator(value: int, operator: str) -> int:
    """Value of `value <operator>`, e.g. apply_operator(12, "+5") == 17."""
    return value + int(operator)


def offset_word(offset: int) -> str:
    """The signed token of a running offset: offset_word(12) == "+12", offset_word(0) == "+0"."""
    if abs(offset) > MAX_OFFSET:
        raise ValueError(f"offset {offset} exceeds +-{MAX_OFFSET}")
    return f"+{offset}" if offset >= 0 else str(offset)
