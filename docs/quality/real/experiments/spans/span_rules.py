"""Session 19 diagnostic (validation split only): which ranking of the shipped scores keeps the needle lines?

    python docs/quality/real/experiments/spans/span_rules.py scores --tasks build/real-tasks/val-2048-pk96.jsonl \
        --out build/exp-eval/span-rules/val-2048-pk96.npz          # one full-context pass per task (~4 s each)
    python docs/quality/real/experiments/spans/span_rules.py cover --scores build/exp-eval/span-rules/val-2048-pk96.npz
    python docs/quality/real/experiments/spans/span_rules.py replay --scores ... --rules raw,linemean@96/48 --compressions 0.75,0.88,0.94 [--limit N]

The shipped scorer ranks with one model-wide score per position (the mean over the 90 caches of the score a
token gets when it leaves the 64-token window). Here those scores are computed once per prompt from the
full-context keys and values (prefill under eviction is left out: an upper bound for the engine), and each
ranking rule keeps the 4 sinks, the last 64 tokens and its top long-range tokens under the engine's budget
(ceil((1 - r) * (prompt + 32))). `cover` prints, per rule and compression, how often the asked needle line and
all needle lines are kept whole; `replay` greedily answers on the full-context cache cut to the kept set
(kept-set/replay_kept_set.py's method), so a rule is judged on answers, not only on coverage.
Rules: raw (own score); sentmax[@L] / linemax[@L] (best score of the sentence / line, spans cut at L tokens,
default 48); sentmean@K[/L] / linemean@K[/L] (mean of the span's best K scores; K = 96 is the whole span's
mean); lead@R (a token is worth the best of itself and the next R tokens of its sentence); linectr@W (session 20:
line mean of each token's score minus the mean of the W scored tokens around its line); full (replay only: the
whole prompt's cache, the ceiling); needles (cover only: every needle line ranked first, the ceiling of a kept set
chosen before the question); linectrj@W (blank lines joined to the line before them); linectrk@W/K (session 21:
the line's contrast shrunk toward its surroundings by K pseudo-tokens). `replay --families multikey` replays one family.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[5]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kept-set"))

from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from kvpop.eval import encode, scorer as answer_scorer  # noqa: E402
from kvpop_train.scorer.network import load_scorer  # noqa: E402
from replay_kept_set import MODEL_DIR, greedy_answer, needle_lines  # noqa: E402

SCORER = "scorers/smollm2-135m-instruct/scorer_mlstm.pt"
SINKS, WINDOW, MAX_TOKENS = 4, 64, 32


def span_ids(pieces: list[str], sentences: bool, max_span: int, join_blank: bool = False) -> np.ndarray:
    """(S,) span index of each token: a span ends after a newline, (sentences) a . ? ! end, or max_span tokens.
    `join_blank`: a whitespace-only token that would start a span (a blank line) joins the span before it."""
    spans, span, length = [], 0, 0
    for text in pieces:
        if join_blank and length == 0 and spans and not text.strip():
            spans.append(span - 1)
            continue
        spans.append(span)
        length += 1
        if "\n" in text or (sentences and text.rstrip().endswith((".", "?", "!"))) or length == max_span:
            span, length = span + 1, 0
    return np.array(spans, np.int64)


# -- ranking rules: (S,) score (-inf where not a candidate), spans -> (S,) priority --------------------------

def pool_max(score: np.ndarray, span: np.ndarray) -> np.ndarray:
    best = np.full(span.max() + 1, -np.inf)
    np.maximum.at(best, span, score)
    return best[span]


def pool_mean_top(score: np.ndarray, span: np.ndarray, top: int) -> np.ndarray:
    out = np.empty(span.max() + 1)
    for s in range(span.max() + 1):
        values = np.sort(score[span == s])[::-1]
        values = values[np.isfinite(values)][:top]
        out[s] = values.mean() if len(values) else -np.inf
    return out[span]


def lead_in(score: np.ndarray, span: np.ndarray, radius: int) -> np.ndarray:
    """A token is worth the best score of itself and the next `radius` tokens of its own span."""
    out = score.copy()
    for shift in range(1, radius + 1):
        ahead = np.full_like(score, -np.inf)
        ahead[:-shift] = np.where(span[shift:] == span[:-shift], score[shift:], -np.inf)
        out = np.maximum(out, ahead)
    return out


def shrunk_contrast(score: np.ndarray, span: np.ndarray, width: int, prior: float) -> np.ndarray:
    """linectr with the line's mean shrunk toward its surroundings by `prior` pseudo-tokens: a one-token
    line's mean is one noisy score, a 22-token line's is not."""
    contrast = local_contrast(score, span, width)
    out = score.copy()
    finite = np.isfinite(score)
    for s in np.unique(span[finite]):
        members = (span == s) & finite
        count = members.sum()
        out[members] = contrast[members].mean() * count / (count + prior)
    return out


def local_contrast(score: np.ndarray, span: np.ndarray, width: int) -> np.ndarray:
    """Each scored token's score minus the mean score of the `width` scored tokens around its span (half before,
    half after, the span itself left out): a line worth keeping stands out from the text around it, wherever
    it sits (the scores fall ~1.5 from the prompt's first tokens to its middle)."""
    out = score.copy()
    scored = np.flatnonzero(np.isfinite(score))
    values, spans_of = score[scored], span[scored]
    total = np.concatenate([[0.0], np.cumsum(values)])
    for s in np.unique(spans_of):
        first, stop = np.searchsorted(spans_of, s, "left"), np.searchsorted(spans_of, s, "right")
        before, after = max(first - width // 2, 0), min(stop + width // 2, len(values))
        count = (first - before) + (after - stop)
        if count:
            out[scored[first:stop]] -= (total[first] - total[before] + total[after] - total[stop]) / count
    return out


def rule_priority(rule: str, score: np.ndarray, spans: dict[str, np.ndarray]) -> np.ndarray:
    name, _, arg = rule.partition("@")
    own = 1e-3 * np.where(np.isfinite(score), score, 0)
    if name == "raw":
        return score
    if name in ("sentmax", "linemax"):
        return pool_max(score, spans[name[:-3] + (f"{arg}" if arg else "48")]) + own
    if name == "sentmean":  # mean of the span's best `top` tokens, spans of at most `length` tokens
        top, _, length = arg.partition("/")
        return pool_mean_top(score, spans[f"sent{length or 48}"], int(top)) + own
    if name == "linemean":
        top, _, length = arg.partition("/")
        return pool_mean_top(score, spans[f"line{length or 48}"], int(top)) + own
    if name == "linectr":  # line mean of the local contrast, `width` tokens around the line
        return pool_mean_top(local_contrast(score, spans["line48"], int(arg)), spans["line48"], 10**6) + own
    if name == "linectrj":  # linectr with blank lines joined to the line before them
        return pool_mean_top(local_contrast(score, spans["line48j"], int(arg)), spans["line48j"], 10**6) + own
    if name == "linectrk":  # linectr@W/K: the line's contrast shrunk by K pseudo-tokens toward its surroundings
        width, _, prior = arg.partition("/")
        return shrunk_contrast(score, spans["line48"], int(width), float(prior)) + own
    if name == "lead":  # lead-in within sentences of <= 48 tokens
        return lead_in(score, spans["sent48"], int(arg)) + own
    raise ValueError(rule)


def kept_set(priority: np.ndarray, candidates: np.ndarray, long_range: int, length: int) -> set[int]:
    """Sinks + last WINDOW prompt tokens + the top `long_range` candidates by priority."""
    order = candidates[np.argsort(-priority[candidates], kind="stable")][: max(long_range, 0)]
    return set(range(SINKS)) | set(range(max(length - WINDOW, 0), length)) | set(order.tolist())


def compute_scores(args) -> None:
    torch.set_num_threads(2)
    tokenizer = AutoTokenizer.from_pretrained(MODEL_DIR)
    model = AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32).eval()
    network = load_scorer(SCORER)
    network.config = dataclasses.replace(network.config, window=WINDOW)  # --window: the scorer pairs each token with the state WINDOW steps later
    tasks = [json.loads(line) for line in args.tasks.read_text().splitlines()]
    out = {}
    for number, task in enumerate(tasks):
        ids = encode(tokenizer, task["prompt"])
        with torch.no_grad():
            cache = model(torch.tensor([ids[:-1]]), use_cache=True).past_key_values
            key = torch.cat([layer.keys for layer in cache.layers])  # (L, Hkv, S, D) RoPE applied
            value = torch.cat([layer.values for layer in cache.layers])
            score = network.score_sequence(key, value).mean(dim=(0, 1))  # (S - w,) the shared ranking
        out[f"ids{number}"] = np.array(ids)
        out[f"score{number}"] = score.numpy()
        print(f"[{number + 1}/{len(tasks)}] {task['family']} {len(ids)} tokens", flush=True)
    out["answers"] = np.array([str(task["answer"]) for task in tasks])
    out["families"] = np.array([task["family"] for task in tasks])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    np.savez(args.out, **out)


def task_views(tokenizer, data, number: int):
    ids = data[f"ids{number}"].tolist()
    prompt = len(ids) - 1  # the last prompt token is fed at the first decode step
    raw = data[f"score{number}"]
    score = np.full(prompt, -np.inf)
    score[SINKS: len(raw)] = raw[SINKS:]  # only tokens that left the window have a score
    pieces = [tokenizer.decode([token]) for token in ids[:prompt]]
    spans = {f"sent{m}": span_ids(pieces, True, m) for m in (16, 24, 32, 48, 64, 96)} | {f"line{m}": span_ids(pieces, False, m) for m in (24, 32, 48, 64, 96)}
    spans["line48j"] = span_ids(pieces, False, 48, join_blank=True)
    candidates = np.arange(SINKS, max(prompt - WINDOW, SINKS))
    return ids, prompt, score, spans, candidates


def cover(args) -> None:
    tokenizer = AutoTokenizer.from_pretrained(MODEL_DIR)
    data = np.load(args.scores)
    rules = args.rules.split(",")
    count = len(data["answers"])
    views = []
    for number in range(count):
        ids, prompt, score, spans, candidates = task_views(tokenizer, data, number)
        asked = needle_lines(tokenizer, ids, 0, containing=str(data["answers"][number]))
        digits = {p for p in asked if tokenizer.decode([ids[p]]).strip().isdigit()}
        views.append((ids, prompt, score, spans, candidates, asked, needle_lines(tokenizer, ids, 0), digits))
    families = data["families"]
    print("rule        compression  asked-line-whole  all-needles-whole  asked-digits  (of", count, "tasks)  asked-line-whole by family")
    for ratio in args.compressions:
        for rule in rules:
            asked_whole = all_whole = digits_kept = 0
            by_family = dict.fromkeys(sorted(set(families)), 0)
            for number, (ids, prompt, score, spans, candidates, asked, every, digits) in enumerate(views):
                budget = math.ceil((1 - ratio) * (len(ids) + MAX_TOKENS))
                if rule == "needles":  # the question-agnostic ceiling: every needle line first (earliest first)
                    priority = rule_priority("linectr@384", score, spans).copy()
                    priority[sorted(every)] = np.inf
                else:
                    priority = rule_priority(rule, score, spans)
                kept = kept_set(priority, candidates, budget - SINKS - WINDOW, prompt)
                asked_whole += asked <= kept
                by_family[families[number]] += asked <= kept
                all_whole += every <= kept
                digits_kept += digits <= kept
            print(f"{rule:12s} {ratio:.2f}  {asked_whole:4d}  {all_whole:4d}  {digits_kept:4d}  {by_family}", flush=True)


def replay(args) -> None:
    torch.set_num_threads(2)
    tokenizer = AutoTokenizer.from_pretrained(MODEL_DIR)
    model = AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32).eval()
    data = np.load(args.scores)
    rules = args.rules.split(",")
    is_correct = answer_scorer("contains")
    count = min(len(data["answers"]), args.limit or 10**9)
    families_wanted = set(args.families.split(",")) if args.families else set(data["families"])
    numbers = [number for number in range(count) if data["families"][number] in families_wanted]
    right = {(rule, ratio): [] for rule in rules for ratio in args.compressions}
    for number in numbers:
        ids, prompt, score, spans, candidates = task_views(tokenizer, data, number)
        with torch.no_grad():
            cache = model(torch.tensor([ids[:-1]]), use_cache=True).past_key_values
        full = [(layer.keys, layer.values) for layer in cache.layers]
        for ratio in args.compressions:
            budget = math.ceil((1 - ratio) * (len(ids) + MAX_TOKENS))
            for rule in rules:
                if rule == "full":  # the ceiling: the whole prompt's cache
                    kept = torch.arange(prompt)
                else:
                    kept = torch.tensor(sorted(kept_set(rule_priority(rule, score, spans), candidates, budget - SINKS - WINDOW, prompt)))
                for layer, (keys, values) in zip(cache.layers, full):
                    layer.keys, layer.values = keys[:, :, kept], values[:, :, kept]
                text = greedy_answer(model, tokenizer, cache, ids, MAX_TOKENS)
                right[(rule, ratio)].append(int(is_correct(text, str(data["answers"][number]))))
        print(f"[{number + 1}/{count}]", " ".join(f"{r}@{c}={right[(r, c)][-1]}" for r in rules for c in args.compressions), flush=True)
    families = data["families"][numbers]
    summary = {}
    for (rule, ratio), values in right.items():
        values = np.array(values)
        summary[f"{rule} {ratio}"] = {"all": int(values.sum()), **{f: int(values[families == f].sum()) for f in sorted(set(families))}}
        print(f"{rule:12s} {ratio:.2f}", summary[f"{rule} {ratio}"], flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "summary": summary,
                                        "per_task": {f"{r} {c}": v for (r, c), v in right.items()}}, indent=1))


def main() -> None:
    global WINDOW
    parser = argparse.ArgumentParser()
    parser.add_argument("command", choices=("scores", "cover", "replay"))
    parser.add_argument("--tasks", type=Path)
    parser.add_argument("--scores", type=Path)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--rules", default="raw,sentmax,lead@4,lead@8,lead@16,sentmean@3")
    parser.add_argument("--compressions", type=lambda text: [float(x) for x in text.split(",")], default=[0.75, 0.88, 0.94])
    parser.add_argument("--limit", type=int, default=0)
    parser.add_argument("--families", default="", help="replay only these task families (comma list)")
    parser.add_argument("--window", type=int, default=WINDOW, help="protected window (and, for `scores`, the scorer's pairing)")
    args = parser.parse_args()
    WINDOW = args.window
    {"scores": compute_scores, "cover": cover, "replay": replay}[args.command](args)


if __name__ == "__main__":
    main()
