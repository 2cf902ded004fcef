"""Reference model tooling (tokenizer, batches, curriculum, cache policies) and the shipped model."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, LlamaForCausalLM

from kvpop_tasks import TaskConfig, generate_task
from kvpop_train.reference.batches import IGNORE, collate, encode_drill, encode_task
from kvpop_train.reference.curriculum import STAGES, CurriculumState
from kvpop_train.reference.drills import LookupDrill, RepeatDrill, drill_words
from kvpop_train.reference.model import ReferenceModelConfig, build_model, widen_mlp
from kvpop_train.reference.tokenizer import BOS, EOS, VOCAB, encode_words, save_tokenizer

SHIPPED = Path(__file__).resolve().parents[2] / "models" / "reference"


@pytest.fixture(scope="module")
def tiny_model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = ReferenceModelConfig(hidden_size=64, num_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128)
    return build_model(config).eval()


def test_tokenizer_round_trips_through_auto_tokenizer(tmp_path) -> None:
    save_tokenizer(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    task = generate_task(TaskConfig(context_tokens=512), "test", 0)
    ids = tokenizer(task.prompt)["input_ids"]
    assert ids == [VOCAB[BOS]] + encode_words(task.prompt.split())
    assert len(ids) == 512 and tokenizer.unk_token_id not in ids
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == ("<bos>", "<eos>", "<pad>")
    assert tokenizer.decode(ids, skip_special_tokens=True) == task.prompt


def test_loss_only_on_reasoning_and_eos() -> None:
    task = generate_task(TaskConfig(context_tokens=64, hops=1, num_facts=8, questions=2), "train", 0)
    ids, labels, _roles, questions = encode_task(task)
    targets = [label for label in labels if label != IGNORE]
    reasoning = encode_words(task.questions[0].reasoning) + encode_words(task.questions[1].reasoning) + [VOCAB[EOS]]
    assert targets == reasoning and ids[-1] == VOCAB[EOS]
    assert {q for q in questions if q >= 0} == {0, 1}
    batch = collate([task, task])
    assert batch.num_questions == 4 and batch.loss_tokens == 2 * len(reasoning)


def test_drills_put_loss_on_lookups_and_repeats_that_the_context_determines() -> None:
    lookup = LookupDrill(num_facts=6, num_lookups=10)
    words, roles = drill_words(lookup, 5)
    assert (words, roles) == drill_words(lookup, 5) and words != drill_words(lookup, 6)[0]
    facts = {words[i]: words[i + 1] for i in range(0, 3 * 6, 3)}
    lookups = [(words[i], words[i + 1]) for i in range(18, len(words), 3)]
    assert len(lookups) == 10 and all(facts[name] == value for name, value in lookups)
    assert [r for r in roles if r != "none"] == ["retrieve", "format"] * 10
    repeat = RepeatDrill(length=50, min_period=6, max_period=10)
    words, roles = drill_words(repeat, 1)
    period = roles.index("copy")
    assert 6 <= period <= 10 and all(words[i] == words[i - period] for i in range(period, 50))
    ids, labels, _, questions = encode_drill(repeat, 1)
    assert sum(label != IGNORE for label in labels) == 50 - period and set(questions) == {-1, 0}
    batch = collate([(lookup, 0), generate_task(TaskConfig(context_tokens=64, hops=1, num_facts=8, questions=2), "train", 0)])
    assert batch.num_questions == 3


def test_widening_the_mlp_keeps_the_function(tiny_model) -> None:
    config = ReferenceModelConfig(hidden_size=64, num_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128)
    wider, wider_config = widen_mlp(tiny_model, config, 256)
    assert wider_config.intermediate_size == 256 and wider.model.layers[0].mlp.up_proj.weight.shape == (256, 64)
    ids = torch.tensor([encode_words(generate_task(TaskConfig(context_tokens=64, hops=1, num_facts=8), "test", 0).prompt.split())])
    with torch.no_grad():
        torch.testing.assert_close(wider.eval()(input_ids=ids).logits, tiny_model(input_ids=ids).logits)
    with pytest.raises(ValueError):
        widen_mlp(tiny_model, config, 128)


def test_curriculum_advances_on_accuracy_only() -> None:
    state = CurriculumState()
    state.begin(0, 0, 0.0)
    assert not state.report(0.5, step=10, tokens=100, seconds=1.0) and state.stage == 0
    assert state.report(STAGES[0].threshold, step=20, tokens=200, seconds=2.0) and state.stage == 1
    assert state.records[0].passed_step == 20 and state.records[1].name == STAGES[1].name


def _hardest_passed_gate() -> TaskConfig | None:
    summary = json.loads((SHIPPED / "training_summary.json").read_text())
    passed = [r["name"] for r in summary["stages"] if r["passed_step"] is not None]
    if not passed:
        return None
    gate = next(stage.gate for stage in STAGES if stage.name == passed[-1])
    return dataclasses.replace(gate, questions=1)


def test_shipped_model_answers_test_tasks(reference_onnx_model_dir) -> None:
    """Through the one accuracy harness (kvpop_eval.quality): the exported model, run by the engine."""
    from kvpop.engine import Engine
    from kvpop.request import CacheConfig
    from kvpop_eval.quality.harness import evaluate

    gate = _hardest_passed_gate()
    if gate is None:
        pytest.skip("the shipped model has not passed a curriculum stage yet")
    engine = Engine.from_model_dir(reference_onnx_model_dir)
    assert engine.spec.num_kv_heads < engine.spec.num_attention_heads  # grouped-query attention
    tasks = [generate_task(gate, "test", i).to_json() for i in range(8)]
    report = evaluate(engine, tasks, CacheConfig("full"), max_tokens=96)
    right = sum(row["correct"] for row in report["rows"])
    assert right >= 6, f"{right}/8 test tasks right at {gate}"
