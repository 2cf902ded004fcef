"""Session 14 diagnostic: where a trained scorer ranks the asked needle, per (layer, KV head).

    python docs/quality/real/experiments/needle_ranks.py NEW.pt,scorers/smollm2-135m-instruct/scorer_mlstm.pt 4

For the first N validation prompts at 2,048 tokens (build/real-tasks/val-2048-pk24.jsonl), runs the Hugging
Face model over the prompt (kvpop_train.scorer.traces), scores every token as the engine would when it
leaves the window (Scorer.score_sequence), and prints the fraction of the 90 (layer, KV head) caches whose
top 459 / 185 long-range scores (the slots a 75% / 88% budget leaves after 4 sinks and the 64-token window)
include the needle span (the asked digits and the 12 tokens before) and its digits. Validation split only.
"""
import json, sys, re
from pathlib import Path
import torch
sys.path.insert(0, str(Path(__file__).resolve().parents[4]))
from transformers import AutoModelForCausalLM, AutoTokenizer
from kvpop.eval import encode
from kvpop_train.scorer.traces import collect_traces
from kvpop_train.scorer.network import load_scorer
from needle_oracle import needle_span  # the oracle's needle: the answer and the tokens before it

model_dir = "models/smollm2-135m-instruct"
scorer_paths = sys.argv[1].split(",")
n = int(sys.argv[2]) if len(sys.argv) > 2 else 6
torch.set_num_threads(2)
tok = AutoTokenizer.from_pretrained(model_dir)
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
tasks = [json.loads(l) for l in open("build/real-tasks/val-2048-pk24.jsonl")][:n]
scorers = {p: load_scorer(p).eval() for p in scorer_paths}
w = 64
for t in tasks:
    ids = encode(tok, t["prompt"])
    text = tok.decode(ids)
    trace = collect_traces(model, tok, [tok.decode(ids[1:]) if ids[0] == tok.bos_token_id else text], window=w, max_tokens=4096, progress=False)[0]
    S = trace.length
    # needle span: answer digits + 12 tokens before, every occurrence
    tid = tok(text, add_special_tokens=False)["input_ids"]
    digits = sorted(needle_span(tok, tid, str(t["answer"]), 12))
    for p, sc in scorers.items():
        with torch.no_grad():
            score = sc.score_sequence(trace.key.float(), trace.value.float())  # (L,H,S-w)
        valid = [d for d in digits if d < S - w]
        order = score.argsort(dim=-1, descending=True).argsort(dim=-1)  # rank per token
        r = order[:, :, valid].float()  # (L,H,n)
        kept75 = (r < 459).float().mean().item(); kept88 = (r < 185).float().mean().item()
        dig = [d for d in valid if re.fullmatch(r"\s*\d+", tok.decode([tid[d]]))]
        rd = order[:, :, dig].float()
        print(f"{t['family']:9s} S={S} {Path(p).parent.name}/{Path(p).stem}: span kept@75 {kept75:.2f} @88 {kept88:.2f}; digits kept@75 {(rd<459).float().mean():.2f} @88 {(rd<185).float().mean():.2f}; median digit rank {rd.median():.0f}", flush=True)
