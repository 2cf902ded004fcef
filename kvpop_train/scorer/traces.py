"""Trace collection: run the Hugging Face model (torch, full cache) over training texts and record, per
layer and KV head, what the scorer will see at serve time and what it should predict.

Recorded per token: the key AFTER RoPE and the value, exactly what the ONNX decoder step hands the
slot cache (so the runtime needs no extra decoder output and no second copy of the cache); the
future-attention target (kvpop_train.scorer.targets); and the attention the token received while in the
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
import random
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.nn import functional
from tqdm import tqdm

from kvpop_train.scorer.targets import AttentionSums, attention_sums, future_importance

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


@dataclass(frozen=True)
class TraceText:
    """A context, and optionally several continuations of it (say, questions about different facts).

    With continuations, the model runs once per continuation, and only the continuation's queries
    count toward the targets: they are what must still be predicted right after eviction (in a task,
    the questions and their chains of thought, not the filler). A context token's target is the MAX
    over the continuations of its mean future attention: an eviction decision made during the context
    does not know which continuation comes, so a token is worth what the continuation that needs it
    most gives it (as the max over the query heads of a GQA group: a slot matters if any reader needs
    it). Averaging instead ranks a fact one question needs below a fact many need and close to the
    attention filler collects, and measured worse (docs/QUALITY.md).
    """

    context: str
    continuations: tuple[str, ...] = ()

    def runs(self) -> list[str]:
        return [f"{self.context} {continuation}" for continuation in self.continuations] or [self.context]


def read_texts(path: Path) -> list[TraceText]:
    """Texts from a JSONL file: a "text" field; a "context" with "continuations"; or a task's "prompt"
    followed by its "target" when present (the chain of thought is where decode-time eviction happens,
    so it belongs in the traces)."""
    texts = []
    for line in Path(path).read_text().splitlines():
        if not line.strip():
            continue
        record = json.loads(line)
        if "text" in record:
            texts.append(TraceText(record["text"]))
        elif "context" in record:
            texts.append(TraceText(record["context"], tuple(record.get("continuations", ()))))
        else:
            texts.append(TraceText(" ".join(part for part in (record["prompt"], record.get("target", "")) if part)))
    return texts


def task_texts(
    num: int, lengths: tuple[int, ...] = DEFAULT_TASK_LENGTHS, split: str = "train", questions_per_run: int = 8
) -> list[TraceText]:
    """`num` reference-task contexts, cycling through the prompt lengths and two fact densities, each
    continued by questions (with chains of thought) about EVERY fact, `questions_per_run` per run.

    The scorer must learn what a token is worth before the question is known. With one question per
    context, the facts nobody asked get the same near-zero future attention as filler, and the ranking
    loss cannot tell "a fact" from "filler" (measured on 512-token tasks: kvpop:mlp 0.465 at 75%
    compression; 0.730 with 8 questions per context; 0.915 with questions about every fact, only their
    queries counting, max over the runs; docs/QUALITY.md).
    """
    from kvpop_tasks import TaskConfig, generate_task
    from kvpop_tasks.generator import question_words

    configs = [TaskConfig(context_tokens=length) for length in lengths]
    configs += [TaskConfig(context_tokens=length, num_facts=16) for length in lengths]
    texts = []
    for index in range(num):
        task = generate_task(configs[index % len(configs)], split, index)
        names = sorted(task.facts)
        random.Random(index).shuffle(names)
        asked = [question for question in map(task.question_about, names) if question is not None]
        continuations = tuple(
            " ".join(word for question in asked[start : start + questions_per_run]
                     for word in (*question_words(question.name), *question.reasoning))
            for start in range(0, len(asked), questions_per_run)
        )
        texts.append(TraceText(" ".join(task.context), continuations))
    return texts


class _Recorder:
    """Per-forward store filled by the capture attention function, one entry per layer: the keys and
    values so far (a cache's and the new ones) and the attention sums of the forward's queries."""

    def __init__(self, window: int, block_size: int | None) -> None:
        self.window, self.block_size = window, block_size
        self.first_query = 0  # queries before it do not count toward the targets
        self.layers: dict[int, tuple[torch.Tensor, torch.Tensor, AttentionSums]] = {}

    def __call__(self, module, query, key, value, attention_mask, scaling=None, **kwargs):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        if query.shape[0] != 1:
            raise ValueError("trace collection runs one unpadded sequence at a time")
        sums = attention_sums(query[0], key[0], self.window, scaling, self.block_size, self.first_query)
        self.layers[module.layer_idx] = (key[0].half(), value[0].half(), sums)
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)

    def take(self) -> tuple[torch.Tensor, torch.Tensor, AttentionSums]:
        """(key, value, sums) of the last forward, stacked over layers: (L, Hkv, S, D) twice, (L, Hkv, G, S)."""
        key, value, sums = zip(*(self.layers[i] for i in sorted(self.layers)))
        self.layers = {}
        stacked = AttentionSums(torch.stack([s.future for s in sums]), torch.stack([s.in_window for s in sums]))
        return torch.stack(key), torch.stack(value), stacked


def _shared_prefix(runs: list[torch.Tensor]) -> int:
    """Tokens every run's ids agree on (the context, however the tokenizer treats its boundary)."""
    shortest = min(len(ids) for ids in runs)
    same = torch.stack([ids[:shortest] for ids in runs]).eq(runs[0][:shortest]).all(dim=0)
    return int(shortest if same.all() else same.long().argmin())


def _pad(tensor: torch.Tensor, length: int) -> torch.Tensor:
    """Zero-pad the last dimension to `length`."""
    return functional.pad(tensor, (0, length - tensor.shape[-1]))


def _combine(runs: list[AttentionSums], lengths: list[int], context: int, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(future_mean, window_attention) of run 0's tokens from per-run sums (each over its own keys):
    a context token's future mean is the max over the runs (it is worth what the continuation that
    needs it most gives it), a continuation token's is run 0's."""
    first = runs[0].received(window, context, lengths[0])
    future_mean = first.future_mean.clone()
    shared = min(context, *(length - window for length in lengths))
    if len(runs) > 1 and shared > 0:
        means = [run.received(window, context, length).future_mean[..., :shared] for run, length in zip(runs, lengths)]
        future_mean[..., :shared] = torch.stack(means).amax(dim=0)
    return future_mean, first.window


@contextmanager
def capturing_attention(model, name: str, function):
    """Run `model`'s attention through `function` (registered under `name`) inside the block, then restore it."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(name, function)
    # SDPA's masks: without one registered, transformers passes no mask to a custom attention function,
    # and SDPA's is_causal is wrong for queries on top of a cache (it aligns the causal mask top-left).
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    previous = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        yield
    finally:
        model.set_attn_implementation(previous)


@torch.no_grad()
def collect_traces(
    model,
    tokenizer,
    texts: list["str | TraceText"],
    window: int,
    max_tokens: int = 4096,
    block_size: int | None = None,
    progress: bool = True,
    reuse_context: bool = True,
) -> list[Trace]:
    """Run `model` (a HF causal LM) over `texts`, one sequence at a time, and return their traces.

    A TraceText with continuations gives one trace: the first run's keys and values, with targets
    from the continuation queries only; a context token's target is the max over the runs of its mean
    future attention (per query head), then max over the group, in log space.

    With `reuse_context` the context runs once (its keys and values kept in the model's cache, its
    queries giving only the in-window attention, since none of them count toward the targets) and
    each continuation runs on top of that cache, cropped back to the context after it: the cost of
    a text is one context plus its continuations, not one context per continuation. Without it every
    run is a whole forward (the original path, kept as the reference the tests compare against).
    """
    from transformers import DynamicCache

    recorder = _Recorder(window, block_size)
    texts = [TraceText(text) if isinstance(text, str) else text for text in texts]
    traces = []
    with capturing_attention(model, CAPTURE_ATTENTION, recorder):
        for text in tqdm(texts, desc="traces", unit="text", disable=not progress):
            runs = [tokenizer(run, return_tensors="pt").input_ids[0] for run in text.runs()]
            context = 0  # first query that counts: the first continuation token
            if text.continuations:
                context = _shared_prefix([tokenizer(text.context, return_tensors="pt").input_ids[0], *runs])
                # Too long: the context loses its end, not the continuations (their queries are the targets),
                # unless that would leave it no longer than the window; then every run is simply cut.
                keep = max_tokens - max(len(ids) - context for ids in runs)
                if window < keep < context:
                    runs = [torch.cat([ids[:keep], ids[context:]]) for ids in runs]
                    context = keep
            runs = [ids[:max_tokens] for ids in runs]
            runs = [ids for ids in runs if len(ids) > window]
            if not runs:
                continue
            context = min(context, *(len(ids) for ids in runs))  # cut inside the context: no query counts
            recorder.first_query = context
            lengths = [len(ids) for ids in runs]
            if reuse_context and context > 0:
                cache = DynamicCache(config=model.config)
                model(input_ids=runs[0][None, :context], past_key_values=cache, use_cache=True, logits_to_keep=1)
                key, value, context_sums = recorder.take()
                sums = []
                for index, ids in enumerate(runs):
                    if len(ids) <= context:  # nothing after the context (cut by max_tokens): no counted query
                        sums.append(AttentionSums(torch.zeros_like(context_sums.future), torch.zeros_like(context_sums.future)))
                        continue
                    model(input_ids=ids[None, context:], past_key_values=cache, use_cache=True, logits_to_keep=1)
                    run_key, run_value, run_sums = recorder.take()
                    if index == 0:
                        key, value = run_key, run_value
                    sums.append(run_sums)
                    cache.crop(context - len(ids))  # negative: tokens to drop (every transformers version)
                sums[0] = AttentionSums(
                    _pad(sums[0].future, lengths[0]),
                    _pad(sums[0].in_window, lengths[0]) + _pad(context_sums.in_window, lengths[0]),
                )
            else:
                sums = []
                for index, ids in enumerate(runs):
                    model(input_ids=ids[None], use_cache=False, logits_to_keep=1)
                    run_key, run_value, run_sums = recorder.take()
                    if index == 0:
                        key, value = run_key, run_value
                    sums.append(run_sums)
            future_mean, window_attention = _combine(sums, lengths, context, window)
            traces.append(Trace(key, value, future_importance(future_mean), window_attention))
    return traces


def save_traces(traces: list[Trace], path: Path) -> None:
    torch.save([vars(trace) for trace in traces], path)


def load_traces(path: Path) -> list[Trace]:
    return [Trace(**fields) for fields in torch.load(path, weights_only=True)]
