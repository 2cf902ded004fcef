"""Turning tasks into training tensors: one sequence per task, loss only on the answers.

A training sequence is BOS, the context, then every question followed by its chain of thought,
then EOS. Only chain-of-thought words and EOS carry loss: the context and the asked names are
random, so predicting them teaches nothing and only adds noise.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from kvpop_tasks import Task, TaskConfig, generate_task
from kvpop_tasks.generator import FORMAT, question_words
from kvpop_train.reference.drills import Drill, drill_words
from kvpop_train.reference.tokenizer import BOS, EOS, PAD, VOCAB, encode_words

ROLE_IDS: dict[str, int] = {"none": 0, FORMAT: 1, "copy": 2, "compute": 3, "retrieve": 4}
IGNORE = -100


@dataclass
class Batch:
    input_ids: torch.Tensor  # (B, T) long, right-padded with PAD
    labels: torch.Tensor  # (B, T) long: next-token targets, IGNORE where there is no loss
    roles: torch.Tensor  # (B, T) long: ROLE_IDS of the target token, 0 where there is no loss
    question_ids: torch.Tensor  # (B, T) long: which question (global index) a target belongs to, -1 elsewhere
    num_questions: int

    @property
    def loss_tokens(self) -> int:
        return int((self.labels != IGNORE).sum())


Encoded = tuple[list[int], list[int], list[int], list[int]]  # ids, labels, roles, question per position
Example = Task | tuple[Drill, int]  # a task, or (drill, index) for drill_words


def _encode(ids: list[int], targets: list[tuple[str, int]]) -> Encoded:
    """(role, question) of each token as a target -> labels, roles, questions; position i predicts token i + 1."""
    labels = [ids[i + 1] if targets[i + 1][0] != "none" else IGNORE for i in range(len(ids) - 1)] + [IGNORE]
    roles = [ROLE_IDS[targets[i + 1][0]] for i in range(len(ids) - 1)] + [0]
    questions = [targets[i + 1][1] for i in range(len(ids) - 1)] + [-1]
    return ids, labels, roles, questions


def encode_task(task: Task) -> Encoded:
    words = list(task.context)
    targets: list[tuple[str, int]] = []  # (role, question) for each word, aligned with words
    targets += [("none", -1)] * len(words)
    for q, question in enumerate(task.questions):
        asked = question_words(question.name)
        words += asked
        targets += [("none", -1)] * len(asked)
        words += question.reasoning
        targets += [(role, q) for role in question.roles]
    ids = [VOCAB[BOS]] + encode_words(words) + [VOCAB[EOS]]
    return _encode(ids, [("none", -1)] + targets + [(FORMAT, len(task.questions) - 1)])


def encode_drill(drill: Drill, index: int) -> Encoded:
    """Like encode_task; all targets of a drill count as one question."""
    words, roles = drill_words(drill, index)
    ids = [VOCAB[BOS]] + encode_words(words)
    return _encode(ids, [("none", -1)] + [(role, -1 if role == "none" else 0) for role in roles])


def encode(example: Example) -> Encoded:
    return encode_task(example) if isinstance(example, Task) else encode_drill(*example)


def collate(examples: list[Example]) -> Batch:
    return pad_batch([encode(example) for example in examples])


def pad_batch(encoded: list[Encoded]) -> Batch:
    length = max(len(ids) for ids, *_ in encoded)
    rows: list[list[list[int]]] = [[], [], [], []]
    offset = 0
    for ids, labels, roles, questions in encoded:
        pad = length - len(ids)
        rows[0].append(ids + [VOCAB[PAD]] * pad)
        rows[1].append(labels + [IGNORE] * pad)
        rows[2].append(roles + [0] * pad)
        rows[3].append([q + offset if q >= 0 else -1 for q in questions] + [-1] * pad)
        offset += max(questions) + 1
    tensors = [torch.tensor(row, dtype=torch.long) for row in rows]
    return Batch(*tensors, num_questions=offset)


class TrainingStream:
    """Deterministic stream of training batches: task i of the train split is always the same task."""

    def __init__(self, next_index: int = 0) -> None:
        self.next_index = next_index

    def batch(self, mixture: tuple[TaskConfig | Drill, ...], tokens_per_batch: int) -> Batch:
        config = mixture[random.Random(self.next_index).randrange(len(mixture))]
        encoded: list[Encoded] = []
        tokens = 0
        while tokens < tokens_per_batch:
            if isinstance(config, TaskConfig):
                encoded.append(encode_task(generate_task(config, "train", self.next_index)))
            else:
                encoded.append(encode_drill(config, self.next_index))
            tokens += len(encoded[-1][0])
            self.next_index += 1
        return pad_batch(encoded)
