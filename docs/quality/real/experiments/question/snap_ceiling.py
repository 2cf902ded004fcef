"""Session 17 diagnostic (validation split only): how much does knowing the question buy?

    python docs/quality/real/experiments/question/snap_ceiling.py --tasks build/real-tasks/val-2048-pk24.jsonl \
        --compression 0.75 0.88 --observe 32 --out build/diag/snap.json

Each prompt is prefilled with the FULL cache in the Hugging Face model (eager attention); each head then
keeps its sinks, its last `--window` tokens and, of the rest, the tokens the prompt's last `--observe`
tokens (the question and the assistant header) attend to most (SnapKV's vote, Li et al. 2024, with the
question in the window), at the same per-head budget the engine gives a compression level. Greedy
decoding on that cut cache. An upper bound for a bounded cache that sees the question early: the votes
come from queries that saw the whole context. Prints and saves the answers per task.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[5]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kept-set"))

from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from kvpop.eval import encode, scorer  # noqa: E402
from replay_kept_set import MODEL_DIR, greedy_answer  # noqa: E402


def votes(model, ids: list[int], observe: int, pool: int) -> tuple[object, torch.Tensor]:
    """(the full prompt cache, (L, Hkv, N) attention the last `observe` prompt tokens put on each token,
    summed over them and over each GQA group, max-pooled over `pool` neighbours)."""
    with torch.no_grad():
        out = model(torch.tensor([ids[:-1]]), use_cache=True, output_attentions=True)
    per_layer = []
    groups = model.config.num_attention_heads // model.config.num_key_value_heads
    for attention in out.attentions:  # (1, Hq, N, N)
        received = attention[0, :, -observe:, :].sum(dim=1)  # (Hq, N)
        received = received.view(model.config.num_key_value_heads, groups, -1).sum(dim=1)  # (Hkv, N)
        if pool > 1:
            received = torch.nn.functional.max_pool1d(received[None], pool, stride=1, padding=pool // 2)[0]
        per_layer.append(received)
    return out.past_key_values, torch.stack(per_layer)


def keep(vote: torch.Tensor, budget: int, sinks: int, window: int) -> torch.Tensor:
    """(L, Hkv, budget) sorted positions each head keeps."""
    n = vote.shape[-1]
    priority = vote.clone()
    priority[..., :sinks] = float("inf")
    priority[..., max(n - window, 0):] = float("inf")
    return priority.topk(min(budget, n), dim=-1).indices.sort(dim=-1).values


def line_ids(tokenizer, ids: list[int]) -> torch.Tensor:
    """(N,) index of the line (text between newlines) each token belongs to."""
    line, out = 0, []
    for token in ids:
        out.append(line)
        line += tokenizer.decode([token]).count("\n")
    return torch.tensor(out)


def span_votes(vote: torch.Tensor, lines: torch.Tensor) -> torch.Tensor:
    """Each token takes its line's best vote (a tiny share of its own breaks ties inside a line): whole
    lines are kept or dropped, most-voted first."""
    best = torch.full((*vote.shape[:-1], int(lines.max()) + 1), -1.0).scatter_reduce(-1, lines.expand_as(vote), vote, "amax")
    return best.gather(-1, lines.expand_as(vote)) + 1e-3 * vote


def answer(model, tokenizer, cache, kept: torch.Tensor, ids: list[int], max_tokens: int) -> str:
    with torch.no_grad():
        for layer_index, layer in enumerate(cache.layers):  # keys (1, Hkv, N, D), RoPE applied
            index = kept[layer_index][None, :, :, None].expand(-1, -1, -1, layer.keys.shape[-1])
            layer.keys, layer.values = layer.keys.gather(2, index), layer.values.gather(2, index)
    return greedy_answer(model, tokenizer, cache, ids, max_tokens)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tasks", type=Path, required=True)
    parser.add_argument("--compression", type=float, nargs="+", default=[0.75, 0.88])
    parser.add_argument("--observe", type=int, default=32)
    parser.add_argument("--pool", type=int, default=1)
    parser.add_argument("--shared", action="store_true", help="one ranking for every head: the votes summed over layers and heads")
    parser.add_argument("--spans", action="store_true", help="rank whole lines (text between newlines) by their best token's vote, keep lines whole")
    parser.add_argument("--sinks", type=int, default=4)
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(2)
    tokenizer = AutoTokenizer.from_pretrained(MODEL_DIR)
    model = AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32, attn_implementation="eager").eval()
    tasks = [json.loads(line) for line in args.tasks.read_text().splitlines()]
    is_correct, rows = scorer("contains"), []
    for task in tasks:
        ids = encode(tokenizer, task["prompt"])
        cache, vote = votes(model, ids, args.observe, args.pool)  # one prefill serves every level
        full = [(layer.keys, layer.values) for layer in cache.layers]  # cutting and decoding build new tensors
        if args.shared:  # normalised per head first, so no head's scale dominates
            vote = (vote / vote.sum(dim=-1, keepdim=True)).sum(dim=(0, 1), keepdim=True).expand_as(vote)
        if args.spans:
            vote = span_votes(vote, line_ids(tokenizer, ids[:-1]))
        for compression in args.compression:
            for layer, (keys, values) in zip(cache.layers, full):
                layer.keys, layer.values = keys, values
            budget = max(1, round(len(ids) * (1 - compression)))
            text = answer(model, tokenizer, cache, keep(vote, budget, args.sinks, args.window), ids, args.max_tokens)
            correct = is_correct(text, task["answer"])
            rows.append({"index": task["index"], "family": task["family"], "compression": compression, "correct": correct, "text": text})
            print(task["index"], task["family"], compression, correct, repr(text), flush=True)
    for compression in args.compression:
        right = [row for row in rows if row["compression"] == compression and row["correct"]]
        print(f"compression {compression}: {len(right)} of {len(tasks)}", {f: sum(r["family"] == f for r in right) for f in {t["family"] for t in tasks}})
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
