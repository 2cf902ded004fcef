"""Resumable training state and the exported Hugging Face model directory.

The checkpoint (model, optimizer, curriculum, counters, RNG) lets `make reference-model`
continue where the last run stopped; the export is what the rest of the project loads.
Both are written to a temporary file first and renamed, so an interrupted run never leaves a
half-written file behind.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from transformers import GenerationConfig, LlamaForCausalLM

from kvpop_train.reference.curriculum import CurriculumState, StageRecord
from kvpop_train.reference.model import ReferenceModelConfig
from kvpop_train.reference.tokenizer import BOS, EOS, PAD, VOCAB, save_tokenizer

CHECKPOINT_FILE = "state.pt"
SUMMARY_FILE = "training_summary.json"


@dataclass
class TrainingState:
    model_config: ReferenceModelConfig = field(default_factory=ReferenceModelConfig)
    step: int = 0
    tokens: int = 0  # training tokens seen (padding excluded)
    seconds: float = 0.0  # training wall time, summed over runs
    next_task_index: int = 0  # next task of the train split
    curriculum: CurriculumState = field(default_factory=CurriculumState)
    history: list[dict] = field(default_factory=list)  # validation measurements
    exported_rank: tuple[int, float] = (-1, -1.0)  # (stage, gate accuracy) of the exported model
    notes: list[str] = field(default_factory=list)  # changes made to the run, e.g. a widened MLP

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "TrainingState":
        curriculum = data.pop("curriculum")
        state = cls(**{**data, "model_config": ReferenceModelConfig(**data["model_config"])})
        state.curriculum = CurriculumState(
            stage=curriculum["stage"], records=[StageRecord(**r) for r in curriculum["records"]]
        )
        state.exported_rank = tuple(state.exported_rank)
        return state


def save_checkpoint(directory: Path, model: LlamaForCausalLM, optimizer: torch.optim.Optimizer, state: TrainingState) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    payload = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "state": state.to_json(),
        "rng": {"python": random.getstate(), "torch": torch.get_rng_state()},
    }
    temporary = directory / (CHECKPOINT_FILE + ".tmp")
    torch.save(payload, temporary)
    temporary.replace(directory / CHECKPOINT_FILE)


def load_checkpoint(directory: Path) -> dict | None:
    """The raw payload, or None when there is nothing to resume."""
    path = directory / CHECKPOINT_FILE
    if not path.exists():
        return None
    payload = torch.load(path, map_location="cpu", weights_only=False)
    payload["state"] = TrainingState.from_json(payload["state"])
    return payload


def restore_rng(payload: dict) -> None:
    random.setstate(payload["rng"]["python"])
    torch.set_rng_state(payload["rng"]["torch"])


def summarize(state: TrainingState, parameters: int, threads: int, tokens_per_second: float) -> dict:
    """The figures the model card and the shipped training_summary.json report."""
    return {
        "step": state.step,
        "tokens": state.tokens,
        "hours": state.seconds / 3600,
        "tokens_per_second": tokens_per_second,
        "threads": threads,
        "parameters": parameters,
        "stage": state.curriculum.stage,
        "stages": [asdict(record) for record in state.curriculum.records],
        "last_validation": state.history[-1] if state.history else None,
        "model_config": asdict(state.model_config),
        "notes": list(state.notes),
    }


def export_model(directory: Path, model: LlamaForCausalLM, summary: dict, card: str) -> None:
    """Write the shipped model directory: weights, config, tokenizer, generation config, card."""
    directory.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(
        do_sample=False,
        max_new_tokens=96,
        bos_token_id=VOCAB[BOS],
        eos_token_id=VOCAB[EOS],
        pad_token_id=VOCAB[PAD],
    )
    model.save_pretrained(directory)
    save_tokenizer(directory)
    (directory / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
    (directory / "MODEL_CARD.md").write_text(card)
