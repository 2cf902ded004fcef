"""kvpop_eval.kvpress_compare without kvpress: the +question variant's context/question split, its
generation (the press sees the context alone) and compression columns, and the merge of its rows."""

from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path

import pytest

from kvpop_eval.kvpress_compare import Generation, encode, load_tasks, merge, policy_name, split_prompt

SMOLLM = Path(__file__).resolve().parents[2] / "models" / "smollm2-135m-instruct"


class WordTokenizer:
    """Words, spaces and punctuation, with ".\\n\\n" one token (so a context ending in "." straddles the cut)."""

    bos_token_id = 0

    def __init__(self):
        self.vocab: dict[str, int] = {"<bos>": 0}

    def __call__(self, text: str) -> dict:
        pieces = re.findall(r"<\|\w+\|>|\.\n\n|\w+|\s+|.", text)
        return {"input_ids": [self.vocab.setdefault(piece, len(self.vocab)) for piece in pieces]}


def task(context: str, question: str, template: str = "<|user|>{}<|end|><|assistant|>") -> dict:
    return {"context": context, "question": question, "prompt": template.format(f"{context}\n\n{question}"), "answer": "42"}


def test_split_prompt_keeps_the_engine_tokens_and_cuts_where_the_context_ends():
    tokenizer = WordTokenizer()
    record = task("The key is 42 and the sky is blue", "What is the key?")
    ids, context_tokens = split_prompt(tokenizer, record)
    assert ids == encode(tokenizer, record["prompt"])  # the engine's sequence, BOS included
    assert ids[:context_tokens] == encode(tokenizer, "<|user|>The key is 42 and the sky is blue")
    # A token straddling the cut (". + blank line") goes to the question, uncompressed.
    record = task("The key is 42.", "What is the key?")
    ids, context_tokens = split_prompt(tokenizer, record)
    assert ids[:context_tokens] == encode(tokenizer, "<|user|>The key is 42")
    assert ids[context_tokens] == tokenizer.vocab[".\n\n"]


def test_split_prompt_refuses_a_prompt_without_its_context_and_question():
    record = task("The key is 42", "What is the key?")
    record["prompt"] = record["prompt"].replace("\n\n", "\n")
    with pytest.raises(ValueError, match="does not hold its context"):
        split_prompt(WordTokenizer(), record)


@pytest.mark.skipif(not (SMOLLM / "tokenizer.json").exists(), reason="needs models/smollm2-135m-instruct")
def test_split_prompt_on_the_smollm2_chat_template():
    from transformers import AutoTokenizer

    from kvpop_eval.english_tasks import generate_task

    tokenizer = AutoTokenizer.from_pretrained(SMOLLM)
    record = generate_task("passkey", "validation", 0, 256, lambda text: len(tokenizer(text)["input_ids"]))
    record["prompt"] = tokenizer.apply_chat_template([{"role": "user", "content": record["content"]}], tokenize=False,
                                                     add_generation_prompt=True)
    ids, context_tokens = split_prompt(tokenizer, record)
    assert ids == encode(tokenizer, record["prompt"])
    assert tokenizer.decode(ids[context_tokens:]) == f"\n\n{record['question']}<|im_end|>\n<|im_start|>assistant\n"


def test_question_variant_needs_context_and_question(tmp_path):
    path = tmp_path / "tasks.jsonl"
    path.write_text(json.dumps({"prompt": "p", "answer": "a"}) + "\n" + json.dumps(task("c", "q")) + "\n")
    assert len(load_tasks(path, None)) == 2  # the other variants need prompt and answer only
    with pytest.raises(ValueError, match=r"--variants question needs 'context' and 'question'.*\[1\]"):
        load_tasks(path, None, split=True)
    assert policy_name("snapkv", "question") == "kvpress:snapkv+question"
    assert policy_name("snapkv", "decoding") == "kvpress:snapkv+decoding" and policy_name("snapkv", "prefill") == "kvpress:snapkv"


def test_question_compression_columns_count_the_question_as_kept():
    # P = 100 prompt tokens, C = 80 context kept at 20, Q = 20 question tokens, G = 5 generated.
    generation = Generation(output_ids=[1] * 5, prompt_tokens=100, kept_after_prefill=40, final_cache=44, peak_cache=44,
                            budget=None, context_tokens=80, kept_context=20)
    assert generation.compressions() == pytest.approx(
        {"compression": 1 - 44 / 104, "prompt_compression": 1 - 40 / 100, "context_compression": 1 - 20 / 80})
    assert "context_compression" not in Generation([1], 100, 25, 25, 25, None).compressions()


class FakePress:
    """A press's context manager, as kvpress's: while active, every forward of the model is recorded,
    and a prefill forward keeps only its first `keep` tokens."""

    def __init__(self, keep: int):
        self.keep, self.seen = keep, []

    @contextlib.contextmanager
    def __call__(self, model):
        def hook(module, args, kwargs, output):
            length = kwargs["input_ids"].shape[1]
            self.seen.append(length)
            if length > 1:
                cache = kwargs.get("past_key_values") or kwargs.get("cache")  # transformers 5.2 / later 5.x
                for layer in cache.layers:  # as kvpress prunes: the keys and values it keeps, per layer
                    layer.keys, layer.values = layer.keys[:, :, : self.keep], layer.values[:, :, : self.keep]

        handle = model.model.register_forward_hook(hook, with_kwargs=True)
        try:
            yield
        finally:
            handle.remove()


def test_question_generation_prunes_the_context_alone(tmp_path):
    pytest.importorskip("torch")
    from kvpop_eval.kvpress_compare import PressRunner
    from export.tiny_model import build_tiny_llama

    runner = PressRunner(build_tiny_llama(tmp_path / "tiny"), max_tokens=6)
    runner.eos_ids = set()  # a random model: generate max_tokens every time
    prompt_ids = encode(runner.tokenizer, "Let a = 7. Let b = a + 5. The quick brown fox jumps over the lazy dog. What is b?")
    context_tokens = len(prompt_ids) - 5
    whole = runner.generate(prompt_ids, None, None)
    split = runner.generate(prompt_ids, FakePress(keep=context_tokens), None, context_tokens)  # keeps it all
    assert split.output_ids == whole.output_ids  # the split alone changes nothing: same tokens, same positions
    press = FakePress(keep=4)
    pruned = runner.generate(prompt_ids, press, None, context_tokens)
    assert press.seen == [context_tokens]  # the press saw the context's prefill only
    assert (pruned.kept_context, pruned.kept_after_prefill) == (4, 4 + 5)
    assert pruned.final_cache == 4 + 5 + 6 - 1 and pruned.tokens_seen == len(prompt_ids) + 6 - 1
    assert pruned.compressions()["context_compression"] == pytest.approx(1 - 4 / context_tokens)


def test_merge_accepts_question_rows(tmp_path):
    pytest.importorskip("matplotlib")
    row = {"policy": "full", "compression": 0.0, "accuracy": 1.0, "tasks": 2, "correct_by_task": "11"}
    (tmp_path / "sweep.json").write_text(json.dumps({"tasks": 2, "scoring": "contains", "tasks_sha256": "x", "results": [row]}))
    definitions = {"compression": "r"}
    peer = {"kvpress_version": "0.5.5", "transformers_version": "5.2", "torch_version": "2", "model": "m",
            "tasks_file": "t", "tasks_sha256": "x", "tasks": 2, "scoring": "contains", "max_tokens": 64,
            "full_accuracy_hf": 1.0, "definitions": definitions,
            "results": [{"policy": "kvpress:snapkv+question", "compression": 0.0, "accuracy": 1.0, "compression_achieved": 0.0,
                         "tasks": 2, "note": "full"},
                        {"policy": "kvpress:snapkv+question", "compression": 0.75, "accuracy": 0.5, "compression_achieved": 0.7,
                         "prompt_compression": 0.73, "context_compression": 0.75, "variant": "question", "tasks": 2,
                         "correct_by_task": "10", "seconds": 3.0}]}
    (tmp_path / "kvpress.json").write_text(json.dumps(peer))
    summary = merge(tmp_path / "kvpress.json", tmp_path)
    assert [row["policy"] for row in summary] == ["full", "kvpress:snapkv+question", "kvpress:snapkv+question"]
    table = (tmp_path / "sweep.md").read_text()
    assert "| kvpress:snapkv+question | 1.000 | 0.500 |" in table and "| kvpress:snapkv+question | 70.0% |" in table


def test_merge_adds_a_later_press_to_an_earlier_ones_rows(tmp_path):
    """Presses run at different times on the same tasks end in one sweep; a re-run cell replaces its own."""
    pytest.importorskip("matplotlib")
    full = {"policy": "full", "compression": 0.0, "accuracy": 1.0, "tasks": 2, "correct_by_task": "11"}
    (tmp_path / "sweep.json").write_text(json.dumps({"tasks": 2, "scoring": "contains", "tasks_sha256": "x", "tasks_file": "t",
                                                     "results": [full]}))

    def run(press, accuracy, name):
        rows = [{"policy": f"kvpress:{press}", "compression": 0.0, "accuracy": 1.0, "compression_achieved": 0.0, "tasks": 2,
                 "note": "full"},
                {"policy": f"kvpress:{press}", "compression": 0.88, "accuracy": accuracy, "compression_achieved": 0.87,
                 "tasks": 2, "correct_by_task": "10" if accuracy == 0.5 else "00"}]
        peer = {"kvpress_version": "0.5.5", "transformers_version": "5.2", "torch_version": "2", "model": "m",
                "tasks_file": "t", "tasks_sha256": "x", "tasks": 2, "scoring": "contains", "max_tokens": 32,
                "full_accuracy_hf": 1.0, "definitions": {}, "results": rows}
        (tmp_path / name).write_text(json.dumps(peer))
        return tmp_path / name

    merge(run("snapkv", 0.5, "a.json"), tmp_path)
    merge(run("expected_attention", 0.0, "b.json"), tmp_path)
    summary = merge(run("expected_attention", 0.5, "c.json"), tmp_path)
    assert [(row["policy"], row["compression"], row["accuracy"]) for row in summary] == [
        ("full", 0.0, 1.0), ("kvpress:snapkv", 0.0, 1.0), ("kvpress:snapkv", 0.88, 0.5),
        ("kvpress:expected_attention", 0.0, 1.0), ("kvpress:expected_attention", 0.88, 0.5)]
    assert "| kvpress:snapkv | 87.0% |" in (tmp_path / "sweep.md").read_text()

    # An engine run merged in first (quality --merge), then one more compression of a press: every row stays.
    from kvpop_eval.quality import merge_sweeps

    engine = tmp_path / "engine"
    engine.mkdir()
    h2o = {"policy": "h2o", "compression": 0.88, "accuracy": 0.0, "tasks": 2, "correct_by_task": "00"}
    (engine / "sweep.json").write_text(json.dumps({"tasks": 2, "scoring": "contains", "tasks_sha256": "x", "tasks_file": "t",
                                                   "results": [full, h2o]}))
    merged = tmp_path / "merged"
    merge_sweeps([tmp_path, engine], merged)
    later = run("snapkv", 0.0, "d.json")
    peer = json.loads(later.read_text())
    peer["results"][1]["compression"] = 0.94
    later.write_text(json.dumps(peer))
    summary = merge(later, merged)
    assert {(row["policy"], row["compression"]) for row in summary if row["compression"]} == {
        ("h2o", 0.88), ("kvpress:snapkv", 0.88), ("kvpress:snapkv", 0.94), ("kvpress:expected_attention", 0.88)}

