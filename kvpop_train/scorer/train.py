"""`python -m kvpop_train.scorer.train --model DIR --out DIR`: train the KVpop scorers on traces of a model.

Loss: a pairwise ranking loss at the eviction boundary. When token u leaves the window, the decision
that matters is whether it beats the weakest token currently kept in the k long-range slots. With
fixed scores, "evict the lowest of leaving vs kept" keeps exactly the top k of all tokens that have
left so far, so under the target itself the weakest kept token is the k-th best earlier leaver:
computable once per trace for several budgets k. Each such pair gives a logistic loss on the score
difference, weighted by how much the two targets differ (near-ties carry no signal). A small
regression term to the target keeps scores comparable across time, since a kept token's score was
given many steps before the token it is compared with (Huber, so tokens at the target's floor do not
dominate). The base model is never changed.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch.nn import functional
from tqdm import tqdm

from kvpop.policies.kvpop.text_spans import SPAN_POOLINGS
from kvpop_train.scorer.network import KINDS, Scorer, ScorerConfig, save_scorer
from kvpop_train.scorer.targets import TARGET_SCOPES, shape_target, value_weighted
from kvpop_train.scorer.traces import Trace, collect_traces, load_traces, read_texts, save_traces, task_texts

CHECKPOINT_NAME = "scorer_{kind}.pt"
REPORT_NAME = "training_report.json"


@dataclass(frozen=True)
class TrainConfig:
    window: int = 64  # w: must match the kvpop policy's window at serve time
    sinks: int = 4  # s: never scored, never compared
    long_range_slots: tuple[int, ...] = (16, 32, 64, 128, 256)  # k: budgets whose boundaries are trained
    memory_dim: int = 16
    hidden_dim: int = 32
    attention_feature: bool = False  # see ScorerConfig.attention_feature
    steps: int = 6000  # upper bound; the time budget usually ends training first
    minutes_per_kind: float = 10.0
    learning_rate: float = 3e-3
    weight_decay: float = 1e-4
    regression_weight: float = 0.5  # measured: 0.05 and 2.0 kept fewer needed tokens at 88-94% (docs/QUALITY.md)
    margin_cap: float = 2.0  # pair weight = min(|target difference|, cap)
    target_span: int = 0  # see targets.shape_target: 0 = each token's own importance
    target_scope: str = "head"  # see targets.shape_target: head | layer | model
    target_value_norm: bool = False  # see targets.value_weighted: attention times the token's value norm
    span_pooling: str = ""  # see ScorerConfig.span_pooling: how serving ranks with the scores (not trained on)
    chunk_size: int = 64
    validation_fraction: float = 0.1
    seed: int = 0


@dataclass
class Boundaries:
    """For each head, budget k and leaving token u: the weakest kept token under the target (-1: none)."""

    index: torch.Tensor  # (L, Hkv, K, S - w) int64


def eviction_boundaries(target: torch.Tensor, sinks: int, slots: tuple[int, ...]) -> Boundaries:
    """Weakest kept long-range token at each leave under the target-ordered policy. (L, Hkv, S - w) ->."""
    layers, kv_heads, scored = target.shape
    index = torch.full((layers, kv_heads, len(slots), scored), -1, dtype=torch.int64)
    values = target.tolist()
    for layer in range(layers):
        for head in range(kv_heads):
            row = values[layer][head]
            for slot_index, budget in enumerate(slots):
                kept: list[tuple[float, int]] = []  # min-heap of (target, token): the k kept so far
                out = index[layer, head, slot_index]
                weakest = []
                for token in range(sinks, scored):
                    weakest.append(kept[0][1] if len(kept) == budget else -1)
                    if len(kept) < budget:
                        heapq.heappush(kept, (row[token], token))
                    elif row[token] > kept[0][0]:
                        heapq.heapreplace(kept, (row[token], token))
                out[sinks:] = torch.tensor(weakest, dtype=torch.int64)
    return Boundaries(index)


def pairwise_loss(score: torch.Tensor, target: torch.Tensor, boundaries: Boundaries, config: TrainConfig):
    """(loss, correctly ordered pairs, pairs) for one trace's scores and targets (L, Hkv, S - w)."""
    index = boundaries.index  # (L, Hkv, K, S - w)
    valid = index >= 0
    score, target = score[:, :, None].expand_as(index), target[:, :, None].expand_as(index)
    score_kept, target_kept = torch.gather(score, 3, index.clamp_min(0)), torch.gather(target, 3, index.clamp_min(0))
    difference = target - target_kept  # > 0: the leaving token should win
    sign, margin = torch.sign(difference), score - score_kept
    weight = difference.abs().clamp_max(config.margin_cap) * valid
    ranking = (weight * functional.softplus(-sign * margin)).sum() / weight.sum().clamp_min(1e-6)
    leaving = (slice(None), slice(None), 0, slice(config.sinks, None))  # each token once, sinks excluded
    regression = functional.smooth_l1_loss(score[leaving], target[leaving])
    counted = valid & (difference != 0)
    correct = (margin * sign > 0) & counted
    return ranking + config.regression_weight * regression, int(correct.sum()), int(counted.sum())


@dataclass
class TrainingSet:
    """Traces with the targets trained on (shaped by the config) and their eviction boundaries (computed
    once, shared by every scorer variant)."""

    traces: list[Trace]
    targets: list[torch.Tensor]  # (L, Hkv, S - w) each
    boundaries: list[Boundaries]

    @classmethod
    def build(cls, traces: list[Trace], config: TrainConfig) -> "TrainingSet":
        targets = [
            shape_target(value_weighted(t.target, t.value) if config.target_value_norm else t.target,
                         config.target_span, config.target_scope)
            for t in traces
        ]
        return cls(traces, targets, [_boundaries(target, config) for target in targets])


def _boundaries(target: torch.Tensor, config: TrainConfig) -> Boundaries:
    """With a model-wide target every cache has the same boundaries: computed once, not L * Hkv times."""
    if config.target_scope != "model":
        return eviction_boundaries(target, config.sinks, config.long_range_slots)
    layers, kv_heads, _ = target.shape
    one = eviction_boundaries(target[:1, :1], config.sinks, config.long_range_slots).index  # (1, 1, K, S - w)
    return Boundaries(one.expand(layers, kv_heads, -1, -1))


def _inputs(trace: Trace) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return trace.key.float(), trace.value.float(), trace.window_attention


@torch.no_grad()
def evaluate(scorer: Scorer | None, data: TrainingSet, config: TrainConfig) -> float:
    """Boundary ranking accuracy: the fraction of (leaving, weakest kept) pairs ordered like the target.
    `scorer=None` ranks by the in-window attention alone instead (the attention-based baseline)."""
    correct = counted = 0
    for trace, target, boundary in zip(data.traces, data.targets, data.boundaries):
        if scorer is None:
            score = trace.window_attention
        else:
            score = scorer.eval().score_sequence(*_inputs(trace), chunk_size=config.chunk_size)
        _, right, total = pairwise_loss(score, target, boundary, config)
        correct, counted = correct + right, counted + total
    return correct / max(counted, 1)


def train_scorer(
    kind: str, training: TrainingSet, validation: TrainingSet, config: TrainConfig, progress: bool = True
) -> tuple[Scorer, dict]:
    """Train one scorer variant; returns it with a report (steps, time, validation accuracies)."""
    torch.manual_seed(config.seed)
    rng = random.Random(config.seed)
    traces = training.traces
    layers, kv_heads, _, head_dim = traces[0].key.shape
    scorer = Scorer(
        ScorerConfig(
            kind=kind, num_layers=layers, num_kv_heads=kv_heads, head_dim=head_dim, window=config.window,
            memory_dim=config.memory_dim, hidden_dim=config.hidden_dim, attention_feature=config.attention_feature,
            shared_ranking=config.target_scope == "model", span_pooling=config.span_pooling,
        )
    )
    sample = rng.sample(traces, min(len(traces), 16))
    scorer.fit_standardisation(*(torch.cat(parts, dim=2) for parts in zip(*(_inputs(trace) for trace in sample))))
    initial_accuracy = evaluate(scorer, validation, config)

    optimizer = torch.optim.AdamW(scorer.parameters(), lr=config.learning_rate, weight_decay=config.weight_decay)
    budget_s, start = config.minutes_per_kind * 60, time.time()
    bar = tqdm(total=config.steps, desc=f"train {kind}", unit="step", disable=not progress)
    step, running = 0, None
    while step < config.steps and time.time() - start < budget_s:
        # Cosine decay over the expected number of steps (whichever of steps and time ends first).
        elapsed = time.time() - start
        fraction = max(step / config.steps, elapsed / budget_s)
        for group in optimizer.param_groups:
            group["lr"] = config.learning_rate * 0.5 * (1 + math.cos(math.pi * min(fraction, 1.0)))
        scorer.train()
        pick = rng.randrange(len(traces))
        trace = traces[pick]
        score = scorer.score_sequence(*_inputs(trace), chunk_size=config.chunk_size)
        loss, correct, counted = pairwise_loss(score, training.targets[pick], training.boundaries[pick], config)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(scorer.parameters(), 1.0)
        optimizer.step()
        step += 1
        accuracy = correct / max(counted, 1)
        running = accuracy if running is None else 0.95 * running + 0.05 * accuracy
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.3f}", pair_acc=f"{running:.3f}")
    bar.close()
    report = {
        "kind": kind,
        "steps": step,
        "seconds": round(time.time() - start, 1),
        "validation_pair_accuracy_initial": round(initial_accuracy, 4),
        "validation_pair_accuracy": round(evaluate(scorer, validation, config), 4),
        "validation_pair_accuracy_window_attention": round(evaluate(None, validation, config), 4),
        "parameters": sum(p.numel() for p in scorer.parameters()),
    }
    return scorer.eval(), report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvpop_train.scorer.train", description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help="Hugging Face model directory (not modified)")
    parser.add_argument("--out", type=Path, default=None, help="output directory (default: MODEL/scorer)")
    parser.add_argument("--texts", type=Path, default=None, help="JSONL of texts (default: reference task train split)")
    parser.add_argument("--num-texts", type=int, default=192)
    parser.add_argument("--max-tokens", type=int, default=4096, help="tokens per trace (longer texts are cut)")
    parser.add_argument("--kinds", default=",".join(KINDS), help="comma-separated scorer variants to train")
    parser.add_argument("--traces", type=Path, default=None,
                        help="cache file: load the traces from it when it exists, else collect and save them there "
                             "(targets depend on the model, the texts and --window: use one file per combination)")
    parser.add_argument("--more-traces", type=Path, nargs="*", default=[],
                        help="traces saved earlier (by --traces) to train on as well: texts added to a set without "
                             "collecting the ones it has again")
    parser.add_argument("--window", type=int, default=TrainConfig.window)
    parser.add_argument("--hidden-dim", type=int, default=TrainConfig.hidden_dim)
    parser.add_argument("--memory-dim", type=int, default=TrainConfig.memory_dim)
    parser.add_argument("--regression-weight", type=float, default=TrainConfig.regression_weight)
    parser.add_argument("--attention-feature", action="store_true", help="also score from in-window attention")
    parser.add_argument("--target-span", type=int, default=TrainConfig.target_span,
                        help="train on the forward max of the target over this many next tokens")
    parser.add_argument("--target-scope", choices=TARGET_SCOPES, default=TrainConfig.target_scope,
                        help="share the target across a layer's KV heads or all caches (max)")
    parser.add_argument("--target-value-norm", action="store_true",
                        help="weight the target by each token's value norm (attention x |v|)")
    parser.add_argument("--span-pooling", choices=SPAN_POOLINGS, default=TrainConfig.span_pooling,
                        help="serving ranks prompt tokens by their line's mean score ('line') or by how far it stands out from the "
                             "text around the line ('line_contrast'); needs --target-scope model")
    parser.add_argument("--minutes-per-kind", type=float, default=TrainConfig.minutes_per_kind)
    parser.add_argument("--steps", type=int, default=TrainConfig.steps)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    kinds = [kind.strip() for kind in args.kinds.split(",") if kind.strip()]
    unknown = [kind for kind in kinds if kind not in KINDS]
    if unknown:
        parser.error(f"unknown scorer kinds {unknown}; expected some of {KINDS}")
    torch.set_num_threads(args.threads)
    config = TrainConfig(
        window=args.window, attention_feature=args.attention_feature, minutes_per_kind=args.minutes_per_kind,
        steps=args.steps, seed=args.seed, hidden_dim=args.hidden_dim, memory_dim=args.memory_dim,
        regression_weight=args.regression_weight, target_span=args.target_span, target_scope=args.target_scope,
        target_value_norm=args.target_value_norm, span_pooling=args.span_pooling,
    )
    out = args.out or args.model / "scorer"
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    if args.traces and args.traces.exists():
        traces = load_traces(args.traces)
        print(f"[train-scorer] {len(traces)} traces from {args.traces}", flush=True)
    else:
        texts = read_texts(args.texts)[: args.num_texts] if args.texts else task_texts(args.num_texts)
        print(f"[train-scorer] {len(texts)} texts from {args.texts or 'the reference task train split'}", flush=True)
        traces = collect_traces(model, tokenizer, texts, window=config.window, max_tokens=args.max_tokens)
        if args.traces:
            save_traces(traces, args.traces)
    for path in args.more_traces:
        more = load_traces(path)
        traces += more
        print(f"[train-scorer] {len(more)} more traces from {path}", flush=True)
    if len(traces) < 2:
        print(f"[train-scorer] FAILED: need at least 2 texts longer than the window ({config.window})", file=sys.stderr)
        return 1
    random.Random(config.seed).shuffle(traces)
    held_out = max(1, int(len(traces) * config.validation_fraction))
    validation = TrainingSet.build(traces[:held_out], config)
    training = TrainingSet.build(traces[held_out:], config)
    reports = {}
    for kind in kinds:
        scorer, report = train_scorer(kind, training, validation, config)
        save_scorer(scorer, out / CHECKPOINT_NAME.format(kind=kind))
        reports[kind] = report
        print(f"[train-scorer] {kind}: {json.dumps(report)}", flush=True)
    summary = {
        "model": str(args.model),
        "texts": str(args.texts or "kvpop_tasks train split"),
        "traces": {
            "train": len(training.traces), "validation": len(validation.traces), "tokens": sum(t.length for t in traces)
        },
        "config": asdict(config),
        "scorers": reports,
        "seconds": round(time.time() - started, 1),
    }
    (out / REPORT_NAME).write_text(json.dumps(summary, indent=2) + "\n")
    print(f"[train-scorer] wrote {out} in {summary['seconds']}s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
