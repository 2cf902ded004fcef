"""Trace collection: run the Hugging Face model (torch, full cache) over training texts and record, per
layer and KV head, what the scorer will see at serve time and what it should predict.

Recorded per token: the key AFTER RoPE and the value, exactly what the ONNX decoder step hands the
slot cache (so the runtime needs no extra decoder output and no second copy of the cache); the
future-attention target (kvpop.scorer.targets); and the attention the token received while in the
window, what the attention-based stand-in scorer knows, so training reports can compare against it.
Pre-RoPE keys are not recorded: the engine never has them, and the RoPE-invariant part of the key
(the norm of each rotation pair) is recomputed from the post-RoPE key by the network. Queries are
used for the targets and dropped right away, so a trace costs 2 * L * Hkv * S * D fp16 numbers, not
the S x S attention.

The capture is an attention function registered with transformers' AttentionInterface: it receives
the queries and keys after RoPE (and after q/k norms for Qwen3) for every supported architecture,
records, and delegates to SDPA, so the model's outputs are unchanged.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from kvpop.scorer.targets import attention_received

CAPTURE_ATTENTION = "kvpop_trace"
DEFAULT_TASK_LENGTHS = (512, 1024, 2048)  # prompt lengths of the reference benchmark


@dataclass
class Trace:
    """One text's recording. S tokens; tokens t >= S - w never leave the window and have no target."""

    key: torch.Tensor  # (L, Hkv, S, D) float16, RoPE applied
    value: torch.Tensor  # (L, Hkv, S, D) float16
    target: torch.Tensor  # (L, Hkv, S - w) float32, log future-attention importance
    window_attention: torch.Tensor  # (L, Hkv, S - w) float32, log relative attention received in the window

    @property
    def length(self) -> int:
        return self.key.shape[2]


def read_texts(path: Path) -> list[str]:
    """Texts from a JSONL file: a "text" field, or a task's "prompt" followed by its "target" when present
    (the chain of thought is where decode-time eviction happens, so it belongs in the traces)."""
    texts = []
    for line in Path(path).read_text().splitlines():
        if not line.strip():
            continue
        record = json.loads(line)
        if "text" in record:
            texts.append(record["text"])
        else:
            texts.append(" ".join(part for part in (record["prompt"], record.get("target", "")) if part))
    return texts


def task_texts(
    num: int, lengths: tuple[int, ...] = DEFAULT_TASK_LENGTHS, split: str = "train", questions: int = 8
) -> list[str]:
    """`num` reference-task texts (context, then several questions with their chains of thought),
    cycling through the prompt lengths and two fact densities.

    Several questions per context, because the scorer must learn what a token is worth before the
    question is known: with one question, the facts nobody asked get the same near-zero future
    attention as filler, and the ranking loss cannot tell "a fact" from "filler". With questions
    covering most of the facts, the target approaches the attention a fact gets over the question
    distribution (measured: pairwise accuracy alone hid this; sweep in docs/quality).
    """
    from kvpop.tasks import TaskConfig, generate_task
    from kvpop.tasks.generator import question_words

    configs = [TaskConfig(context_tokens=length, questions=questions) for length in lengths]
    configs += [TaskConfig(context_tokens=length, num_facts=16, questions=3) for length in lengths]
    texts = []
    for index in range(num):
        task = generate_task(configs[index % len(configs)], split, index)
        words = list(task.context)
        for question in task.questions:
            words += [*question_words(question.name), *question.reasoning]
        texts.append(" ".join(words))
    return texts


class _Recorder:
    """Per-forward store filled by the capture attention function, one entry per layer."""

    def __init__(self, window: int, block_size: int | None) -> None:
        self.window, self.block_size = window, block_size
        self.layers: dict[int, tuple[torch.Tensor, ...]] = {}

    def __call__(self, module, query, key, value, attention_mask, scaling=None, **kwargs):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        if query.shape[0] != 1:
            raise ValueError("trace collection runs one unpadded sequence at a time")
        received = attention_received(query[0], key[0], self.window, scaling, self.block_size)
        self.layers[module.layer_idx] = (key[0].half(), value[0].half(), received.future, received.window)
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)

    def trace(self) -> Trace:
        fields = zip(*(self.layers[index] for index in sorted(self.layers)))
        self.layers = {}
        return Trace(*(torch.stack(per_layer) for per_layer in fields))


@torch.no_grad()
def collect_traces(
    model,
    tokenizer,
    texts: list[str],
    window: int,
    max_tokens: int = 4096,
    block_size: int | None = None,
    progress: bool = True,
) -> list[Trace]:
    """Run `model` (a HF causal LM) over `texts`, one at a time, and return their traces."""
    from transformers import AttentionInterface

    recorder = _Recorder(window, block_size)
    AttentionInterface.register(CAPTURE_ATTENTION, recorder)
    previous = model.config._attn_implementation
    model.set_attn_implementation(CAPTURE_ATTENTION)
    traces = []
    try:
        for text in tqdm(texts, desc="traces", unit="text", disable=not progress):
            input_ids = tokenizer(text, return_tensors="pt").input_ids[:, :max_tokens]
            if input_ids.shape[1] <= window:
                continue
            model(input_ids=input_ids, use_cache=False, logits_to_keep=1)
            traces.append(recorder.trace())
    finally:
        model.set_attn_implementation(previous)
    return traces


def save_traces(traces: list[Trace], path: Path) -> None:
    torch.save([vars(trace) for trace in traces], path)


def load_traces(path: Path) -> list[Trace]:
    return [Trace(**fields) for fields in torch.load(path, weights_only=True)]
