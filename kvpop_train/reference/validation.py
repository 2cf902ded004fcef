"""Teacher-forced validation: is every chain-of-thought token the model's top choice?

A question whose every reasoning token (and the final answer) is the argmax under teacher
forcing is exactly a question that greedy decoding answers with the reference reasoning, so
this is a one-forward-pass lower bound on greedy exact match. It drives curriculum advances.
Per-role accuracies show which skill lags (retrieval is the one that plateaus).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import LlamaForCausalLM

from kvpop_tasks import Task
from kvpop_train.reference.batches import IGNORE, ROLE_IDS, collate


@dataclass(frozen=True)
class ValidationResult:
    accuracy: float  # fraction of questions with every reasoning token right
    loss: float  # mean cross-entropy over reasoning tokens
    role_accuracy: dict[str, float]  # token accuracy per role (retrieve, copy, compute, format)
    questions: int


@torch.no_grad()
def validate(model: LlamaForCausalLM, tasks: list[Task], tokens_per_batch: int = 8192) -> ValidationResult:
    was_training = model.training
    model.eval()
    wrong_questions = 0
    questions = 0
    loss_sum = 0.0
    loss_tokens = 0
    role_right = torch.zeros(len(ROLE_IDS))
    role_total = torch.zeros(len(ROLE_IDS))
    start = 0
    while start < len(tasks):
        length = 1 + len(tasks[start].context) + sum(4 + len(q.reasoning) for q in tasks[start].questions)
        chunk = tasks[start : start + max(1, tokens_per_batch // length)]
        start += len(chunk)
        batch = collate(chunk)
        logits = model(input_ids=batch.input_ids).logits.float()  # (B, T, V)
        mask = batch.labels != IGNORE  # (B, T)
        loss_sum += float(F.cross_entropy(logits[mask], batch.labels[mask], reduction="sum"))
        loss_tokens += int(mask.sum())
        right = (logits.argmax(-1) == batch.labels) & mask  # (B, T)
        wrong = ~right & mask
        per_question = torch.zeros(batch.num_questions).index_add_(
            0, batch.question_ids[mask], wrong[mask].float()
        )
        wrong_questions += int((per_question > 0).sum())
        questions += batch.num_questions
        role_right.index_add_(0, batch.roles[mask], right[mask].float())
        role_total.index_add_(0, batch.roles[mask], torch.ones(int(mask.sum())))
    model.train(was_training)
    names = {index: name for name, index in ROLE_IDS.items()}
    return ValidationResult(
        accuracy=1.0 - wrong_questions / max(1, questions),
        loss=loss_sum / max(1, loss_tokens),
        role_accuracy={names[i]: float(role_right[i] / role_total[i]) for i in range(len(names)) if role_total[i] > 0},
        questions=questions,
    )
