"""Session 16 diagnostic (validation split only): is an answer lost by WHICH tokens the cache keeps, or by
prefilling the prompt under eviction?

    python docs/quality/real/experiments/kept-set/replay_kept_set.py --model model_repository/kvpop_engine/1 \
        --tasks build/diag/val-t2-6.jsonl --policy kvpop --scorer mlstm --compression 0.75 \
        --scoring contains --max-tokens 32 --window 64 --out build/diag/replay.json

Runs `python -m kvpop.eval` with the arguments given (the engine, shipped scorer, shared ranking: every
cache holds the same positions), records the positions held right after prefill, then replays each task
with the Hugging Face model: the whole prompt prefilled with the FULL cache, that cache cut down to the
held positions, greedy decoding on it. Environment switches:
  REPLAY=slice (default) drop the evicted tokens; zero / mean: keep their keys (the attention mass) but
      zero their values, or replace them by the mean evicted value.
  ADD=needles add every needle line of the prompt ("... magic number(s) for ... / pass key is ...") and
      AFTER tokens after each to the held set; ADD=only keep just those lines, the first 50 and last 64.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[5]))

from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from kvpop import engine as engine_module  # noqa: E402
from kvpop import eval as evaluation  # noqa: E402

MODEL_DIR = "models/smollm2-135m-instruct"
held_after_prefill: dict[str, tuple[list[int], np.ndarray]] = {}  # request id -> (prompt ids, positions (L, Hkv, B))
original_accept = engine_module.Engine._accept


def recording_accept(self, sequence, token):  # the first generated token: the prompt is in the cache
    request = sequence.request
    held_after_prefill.setdefault(request.request_id, (list(request.prompt_ids), sequence.cache.position.copy()))
    return original_accept(self, sequence, token)


def needle_lines(tokenizer, ids: list[int], after: int, containing: str | None = None) -> set[int]:
    """Positions of every needle line of the prompt (not the question at its end) and `after` tokens after;
    with `containing`, only the needle lines that contain that text (the asked needle: its answer)."""
    pieces = [tokenizer.decode([token]) for token in ids]
    starts = np.cumsum([0] + [len(piece) for piece in pieces])
    text = "".join(pieces)
    positions: set[int] = set()
    for match in re.finditer(r"[^\n]*(magic numbers? for|pass key is)[^\n]*", text[: starts[-60]]):
        if containing is not None and containing not in match.group(0):
            continue
        first = np.searchsorted(starts, match.start(), "right") - 1
        last = np.searchsorted(starts, match.end(), "left")
        positions.update(range(first, min(last + after, len(ids) - 1)))
    return positions


def replay(model, tokenizer, ids: list[int], held: list[int], mode: str) -> str:
    with torch.no_grad():
        cache = model(torch.tensor([ids[:-1]]), use_cache=True).past_key_values  # full-context prompt cache
        index = torch.tensor([position for position in held if position < len(ids) - 1])
        for layer in cache.layers:  # keys (1, Hkv, S, D), RoPE applied: positions stay what they were
            if mode == "slice":
                layer.keys, layer.values = layer.keys[:, :, index], layer.values[:, :, index]
                continue
            evicted = torch.ones(layer.values.shape[2], dtype=torch.bool)
            evicted[index] = False
            layer.values[:, :, evicted] = 0 if mode == "zero" else layer.values[:, :, evicted].mean(dim=2, keepdim=True)
    return greedy_answer(model, tokenizer, cache, ids)


def greedy_answer(model, tokenizer, cache, ids: list[int], max_tokens: int = 24) -> str:
    """Greedy decoding from the prompt's last token on `cache` (the rest of the prompt, cut down)."""
    with torch.no_grad():
        token, position, generated = ids[-1], len(ids) - 1, []
        end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        for _ in range(max_tokens):
            out = model(torch.tensor([[token]]), past_key_values=cache, position_ids=torch.tensor([[position]]), use_cache=True)
            token, position = int(out.logits[0, -1].argmax()), position + 1
            if token == end:
                break
            generated.append(token)
    return tokenizer.decode(generated)


def main() -> None:
    engine_module.Engine._accept = recording_accept
    evaluation.main(sys.argv[1:])
    torch.set_num_threads(2)
    tokenizer = AutoTokenizer.from_pretrained(MODEL_DIR)
    model = AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32).eval()
    tasks = [json.loads(line) for line in open(sys.argv[sys.argv.index("--tasks") + 1])]
    mode, add, after = os.environ.get("REPLAY", "slice"), os.environ.get("ADD", ""), int(os.environ.get("AFTER", "0"))
    for (ids, positions), task in zip(held_after_prefill.values(), tasks):
        per_cache = positions.reshape(-1, positions.shape[-1])
        assert (per_cache == per_cache[0]).all(), "a shared ranking holds the same positions in every cache"
        held = {position for position in per_cache[0].tolist() if 0 <= position < len(ids)}
        if add == "needles":
            held |= needle_lines(tokenizer, ids, after)
        elif add == "only":
            held = needle_lines(tokenizer, ids, after) | set(range(50)) | set(range(len(ids) - 64, len(ids)))
        text = replay(model, tokenizer, ids, sorted(held), mode)
        print(task["index"], task["family"], f"held {len(held)} of {len(ids)}", str(task["answer"]) in text, repr(text), flush=True)


if __name__ == "__main__":
    main()
