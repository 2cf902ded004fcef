"""An evaluator of the facts that shares no code with the generator.

It reads only the prompt text, the way a careful human would: find every `name ... ;`
definition, then evaluate the asked name recursively. Tests use it to check that the
generator's answers and chains of thought are right, and that every name is defined once.
"""

from __future__ import annotations

import re

_NUMBER = re.compile(r"^\d+$")
_OPERATOR = re.compile(r"^[+-]\d+$")
_NAME = re.compile(r"^[A-Za-z]$")


def parse_definitions(prompt: str) -> dict[str, tuple[str, ...]]:
    """name -> right-hand side words, e.g. {"b": ("12",), "c": ("b", "+5")}.

    A fact is `<name> <number> ;` or `<name> <name> <operator> ;`; filler holds no names,
    numbers or operators, so any name followed by a number or by a name and an operator
    opens a fact.
    """
    words = prompt.split()
    definitions: dict[str, tuple[str, ...]] = {}
    for end, word in enumerate(words):
        if word != ";":
            continue
        if end >= 2 and _NUMBER.match(words[end - 1]) and _NAME.match(words[end - 2]):
            name, rhs = words[end - 2], (words[end - 1],)
        elif end >= 3 and _OPERATOR.match(words[end - 1]) and _NAME.match(words[end - 2]) and _NAME.match(words[end - 3]):
            name, rhs = words[end - 3], (words[end - 2], words[end - 1])
        else:
            raise ValueError(f"unreadable fact before word {end}: {words[max(0, end - 3) : end + 1]}")
        if name in definitions:
            raise ValueError(f"{name} is defined twice")
        definitions[name] = rhs
    return definitions


def asked_name(prompt: str) -> str:
    words = prompt.split()
    if len(words) < 3 or words[-3] != "?" or words[-1] != ":":
        raise ValueError("prompt does not end with a question '? name :'")
    return words[-2]


def solve(prompt: str) -> int:
    """Value of the asked name."""
    definitions = parse_definitions(prompt)

    def value(name: str, depth: int = 0) -> int:
        if depth > len(definitions):
            raise ValueError("circular definitions")
        rhs = definitions[name]
        if len(rhs) == 1:
            return int(rhs[0])
        parent, operator = rhs
        sign = 1 if operator[0] == "+" else -1
        return value(parent, depth + 1) + sign * int(operator[1:])

    return value(asked_name(prompt))
