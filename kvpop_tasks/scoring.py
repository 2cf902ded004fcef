"""Exact-match scoring of the final answer: the number after `#`, nothing else counts."""

from __future__ import annotations

from kvpop_tasks.language import FINAL


def extract_final_answer(text: str) -> str | None:
    """The word after the first `#` in generated text, or None when the model never answered."""
    words = text.split()
    for i, word in enumerate(words[:-1]):
        if word == FINAL:
            return words[i + 1]
    return None


def exact_match(generated: str, answer: str) -> bool:
    return extract_final_answer(generated) == answer.strip()


def accuracy(generated: list[str], answers: list[str]) -> float:
    if len(generated) != len(answers):
        raise ValueError(f"{len(generated)} generations for {len(answers)} answers")
    if not answers:
        return 0.0
    return sum(exact_match(g, a) for g, a in zip(generated, answers)) / len(answers)
