"""Head-aware budgets on SmolLM2-135M: does keeping a few retrieval heads whole recover the answers?

An experiment behind docs/quality/real/README.md (nothing here ships; the engine gives every head the
same budget). DuoAttention and RazorAttention observe that a few "retrieval" heads need the whole
context and the rest do with sinks + a recent window. Here, at the same memory as a uniform budget of
(1 - r) x (prompt + 32 generated) slots per head, the k best retrieval heads keep every token and the
other heads keep 4 sinks + the 64 most recent tokens, with k the largest that fits:

    k * N + (H - k) * 68 <= (1 - r) * N * H          (H = 90 KV heads, N = prompt + 32)

    python docs/quality/real/experiments/retrieval_heads.py calibrate --tasks build/real-tasks/train-2048-pk8.jsonl \
        --out build/retrieval/heads.json
    python docs/quality/real/experiments/retrieval_heads.py evaluate --heads build/retrieval/heads.json \
        --tasks build/real-tasks/val-2048-pk8.jsonl --compressions 0.75 0.88 0.94 --out build/retrieval/val.json

`calibrate` (train split only) ranks the KV heads by the attention the gold answer's tokens, teacher
forced after the prompt, put on the needle's tokens in the context (the answer's token ids found in
the prompt), averaged over the group's query heads, the answer tokens and the tasks. `evaluate` runs
Hugging Face greedy decoding (32 tokens) with the whole prompt prefilled at full attention (as
kvpress's prefill presses do) and, at every generated token, each head seeing only what it keeps;
rows: the full cache, head-aware at each r, and the same harness with every head on sinks + a recent
window of the uniform budget (StreamingLLM at r) as the within-harness baseline.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.models.llama import modeling_llama

SINKS, WINDOW, MAX_TOKENS = 4, 64, 32
_original_eager = modeling_llama.eager_attention_forward
_keep: dict = {"mode": None}  # what decode steps may see: set per generation run


def _masked_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """Eager attention; on one-token (decode) queries, heads outside the kept set see only sinks and
    the recent window. (B, Hq, 1, S) scores masked per query head before the softmax."""
    if query.shape[2] != 1 and _keep["mode"] == "select":  # the prefill: each KV head's question-window attention
        output, weights = _original_eager(module, query, key, value, attention_mask, scaling, dropout, **kwargs)
        groups = module.num_key_value_groups
        received = weights[0, :, -WINDOW:, :].sum(1)  # (Hq, S): what the prompt's last 64 queries put on each token
        _keep["prefill"][module.layer_idx] = received.reshape(-1, groups, received.shape[-1]).mean(1)  # (Hkv, S)
        return output, weights
    if query.shape[2] != 1 or _keep["mode"] in (None, "full"):
        return _original_eager(module, query, key, value, attention_mask, scaling, dropout, **kwargs)
    slots = key.shape[2]
    position = torch.arange(slots)
    if _keep["mode"] == "select":  # chosen heads keep sinks + window + their top tokens by prefill attention
        received = _keep["prefill"][module.layer_idx]  # (Hkv, P)
        top = torch.zeros(key.shape[1], slots, dtype=torch.bool)
        chosen = _keep["whole"][module.layer_idx]
        if chosen.any():
            index = received[chosen].topk(min(_keep["budget"], received.shape[-1]), dim=-1).indices
            top[chosen] = torch.zeros(int(chosen.sum()), slots, dtype=torch.bool).scatter(1, index, True)
        visible = top | ((position < SINKS) | (position >= slots - WINDOW))[None, :]
    elif _keep["mode"] == "heads":
        visible_local = (position < SINKS) | (position >= slots - WINDOW)  # (S,)
        whole = _keep["whole"][module.layer_idx]  # (Hkv,) bool: retrieval heads keep every token
        visible = whole[:, None] | visible_local[None, :]  # (Hkv, S)
    else:  # "streaming": every head keeps sinks + the recent (budget - sinks)
        visible = ((position < SINKS) | (position >= slots - (_keep["budget"] - SINKS)))[None, :].expand(key.shape[1], -1)
    visible = visible.repeat_interleave(module.num_key_value_groups, dim=0)  # (Hq, S)
    bias = torch.zeros(visible.shape, dtype=query.dtype).masked_fill(~visible, float("-inf"))[None, :, None, :]
    mask = bias if attention_mask is None else attention_mask + bias
    return _original_eager(module, query, key, value, mask, scaling, dropout, **kwargs)


def load(model_dir: Path):
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    modeling_llama.eager_attention_forward = _masked_attention
    return tokenizer, model


def read_tasks(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def answers_of(task: dict) -> list[str]:
    return task["answer"] if isinstance(task["answer"], list) else [task["answer"]]


def needle_positions(tokenizer, ids: list[int], answers: list[str]) -> list[int]:
    """Prompt positions of each answer's tokens where they occur as a run (as written in the context,
    with or without a leading space)."""
    found = []
    for answer in answers:
        for text in (answer, " " + answer):
            run = tokenizer(text, add_special_tokens=False).input_ids
            starts = [i for i in range(len(ids) - len(run) + 1) if ids[i : i + len(run)] == run]
            if starts:
                found += [start + offset for start in starts for offset in range(len(run))]
                break
    return sorted(set(found))


def calibrate(args) -> int:
    tokenizer, model = load(args.model)
    config = model.config
    layers, kv_heads = config.num_hidden_layers, config.num_key_value_heads
    groups = config.num_attention_heads // kv_heads
    total, counted = np.zeros((layers, kv_heads)), 0
    for number, task in enumerate(read_tasks(args.tasks)):
        prompt = tokenizer(task["prompt"], add_special_tokens=False, return_tensors="pt").input_ids
        answer = tokenizer(" ".join(answers_of(task)), add_special_tokens=False).input_ids
        ids = prompt[0].tolist()
        needle = needle_positions(tokenizer, ids, answers_of(task))
        if not needle:
            continue
        with torch.no_grad():
            out = model(prompt, use_cache=True)
            forced = model(torch.tensor([answer]), past_key_values=out.past_key_values, output_attentions=True)
        for layer, attention in enumerate(forced.attentions):  # (1, Hq, A, P + A)
            mass = attention[0, :, :, needle].sum(-1).mean(-1)  # (Hq,)
            total[layer] += mass.reshape(kv_heads, groups).mean(-1).numpy()
        counted += 1
        print(f"[calibrate] task {number + 1}: prompt {len(ids)} tokens, needle tokens {len(needle)}", flush=True)
    score = total / max(counted, 1)
    order = np.dstack(np.unravel_index(np.argsort(-score, axis=None), score.shape))[0].tolist()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"tasks": str(args.tasks), "counted": counted, "score": score.tolist(),
                                    "ranking": order}, indent=2) + "\n")
    print(f"[calibrate] top heads (layer, kv head): {order[:10]}; scores {sorted(score.ravel())[::-1][:10]}")
    return 0


def full_heads(compression: float, tokens: int, heads: int) -> int:
    """The most whole heads that fit the memory of a uniform budget at `compression`."""
    budget = (1.0 - compression) * tokens * heads
    return max(0, min(heads, math.floor((budget - heads * (SINKS + WINDOW)) / (tokens - SINKS - WINDOW))))


def generate(model, tokenizer, prompt: str) -> str:
    ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def evaluate(args) -> int:
    tokenizer, model = load(args.model)
    config = model.config
    layers, kv_heads = config.num_hidden_layers, config.num_key_value_heads
    ranking = json.loads(args.heads.read_text())["ranking"]
    tasks = read_tasks(args.tasks)
    rows, started = [], time.time()
    systems = [(f"{kind}@{r}", r) for kind in args.systems for r in args.compressions]
    if args.full:
        systems.insert(0, ("full", None))
    for name, compression in systems:
        correct, outputs, begin = 0, [], time.time()
        for task in tasks:
            tokens = len(tokenizer(task["prompt"], add_special_tokens=False).input_ids) + MAX_TOKENS
            if compression is None:
                _keep.update(mode="full")
                detail = {}
            elif name.startswith("heads"):
                k = full_heads(compression, tokens, layers * kv_heads)
                whole = torch.zeros(layers, kv_heads, dtype=torch.bool)
                for layer, head in ranking[:k]:
                    whole[layer, head] = True
                _keep.update(mode="heads", whole=whole)
                detail = {"whole_heads": k}
            elif name.startswith("select"):  # R heads with a quarter of the tokens each, chosen by attention
                budget = (tokens - MAX_TOKENS) // 4
                total = (1.0 - compression) * tokens * layers * kv_heads
                k = max(0, min(layers * kv_heads, math.floor((total - layers * kv_heads * (SINKS + WINDOW)) / budget)))
                whole = torch.zeros(layers, kv_heads, dtype=torch.bool)
                for layer, head in ranking[:k]:
                    whole[layer, head] = True
                _keep.update(mode="select", whole=whole, budget=budget, prefill={})
                detail = {"selecting_heads": k, "head_budget": budget}
            else:
                _keep.update(mode="streaming", budget=max(SINKS + 1, math.ceil((1 - compression) * tokens)))
                detail = {"budget": _keep["budget"]}
            text = generate(model, tokenizer, task["prompt"])
            ok = all(answer in text for answer in answers_of(task))
            correct += ok
            outputs.append({"index": task["index"], "family": task["family"], "correct": ok, "output": text, **detail})
        rows.append({"system": name, "compression": compression, "correct": correct, "tasks": len(tasks),
                     "accuracy": correct / len(tasks), "seconds": time.time() - begin, "results": outputs})
        print(f"[evaluate] {name:16s} {correct}/{len(tasks)}  ({time.time() - begin:.0f} s)", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"tasks": str(args.tasks), "heads": str(args.heads), "sinks": SINKS, "window": WINDOW,
                                    "max_tokens": MAX_TOKENS, "wall_s": time.time() - started, "rows": rows}, indent=2) + "\n")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    for name in ("calibrate", "evaluate"):
        command = commands.add_parser(name)
        command.add_argument("--model", type=Path, default=Path("models/smollm2-135m-instruct"))
        command.add_argument("--tasks", type=Path, required=True)
        command.add_argument("--out", type=Path, required=True)
    commands.choices["evaluate"].add_argument("--heads", type=Path, required=True)
    commands.choices["evaluate"].add_argument("--compressions", type=float, nargs="+", default=[0.75, 0.88, 0.94])
    commands.choices["evaluate"].add_argument("--systems", nargs="+", default=["heads", "streaming"],
                                              choices=["heads", "select", "streaming"])
    commands.choices["evaluate"].add_argument("--no-full", dest="full", action="store_false", help="leave out the full cache row")
    args = parser.parse_args()
    return calibrate(args) if args.command == "calibrate" else evaluate(args)


if __name__ == "__main__":
    raise SystemExit(main())
