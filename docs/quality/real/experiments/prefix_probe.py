"""Session 13 validation probes behind docs/quality/real/README.md "What the instruction prefix is worth".

    python docs/quality/real/experiments/prefix_probe.py --tasks build/real-tasks/val-2048-pk24.jsonl \
        --full --oracle 12 --sinks 50 --compressions 0.75,0.88 --show

Runs the engine (kvpop.eval.evaluate, greedy, 32 tokens, contains scoring) on the exported SmolLM2 with
the shipped mLSTM scorer, optionally patched (an experiment, nothing here ships):
  * `--sinks S`: the first S prompt tokens are never evicted (50 covers SmolLM2's system turn and the
    task statement that opens the user turn: 47-49 tokens on these tasks).
  * `--oracle N`: the asked answer's digits and the N tokens before them are never evicted (as
    needle_oracle.py); with `--oracle-numbers`, every 6-digit number in the prompt (distractors too).
Tasks: python -m benchmarks.english_tasks write --model models/smollm2-135m-instruct --split validation
--context-tokens 2048 --num 24 --families passkey,multikey --out build/real-tasks/val-2048-pk24.jsonl
"""
import argparse, json, re, sys, time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[4]))
from kvpop import eval as ev
from kvpop.engine import CacheConfig, Engine
from needle_oracle import protect_needles  # the same patch as the session-7 oracle

p = argparse.ArgumentParser()
p.add_argument("--model", default="model_repository/kvpop_engine/1")
p.add_argument("--tasks", required=True)
p.add_argument("--policy", default="kvpop:mlstm")
p.add_argument("--compressions", default="0.75,0.88")
p.add_argument("--oracle", type=int, default=None)
p.add_argument("--oracle-numbers", action="store_true", help="protect every 6-digit number (+N before) in the prompt")
p.add_argument("--sinks", type=int, default=4)
p.add_argument("--window", type=int, default=64)
p.add_argument("--full", action="store_true")
p.add_argument("--show", action="store_true")
p.add_argument("--limit", type=int)
a = p.parse_args()
tasks = ev.load_tasks(Path(a.tasks), a.limit)
engine = Engine.from_model_dir(Path(a.model), device="cpu", max_batch_size=8, prefill_chunk=256)
tok = engine.tokenizer

if a.oracle is not None:
    answers = [str(t["answer"]) for t in tasks]
    numbers = lambda ids: set(re.findall(r"\d{6}", tok.decode(ids)))  # noqa: E731
    protect_needles(tok, numbers if a.oracle_numbers else (lambda ids: answers), a.oracle)

def run(config, label):
    r = ev.evaluate(engine, tasks, config, 32, "contains")
    bits = "".join("1" if row["correct"] else "0" for row in r["rows"])
    print(f"{label}: {sum(map(int,bits))}/{len(bits)} {bits} budget {r['mean_budget']:.0f} ({r['seconds']:.0f}s)", flush=True)
    if a.show:
        for t, row in zip(tasks, r["rows"]):
            if not row["correct"]:
                print(f"   {t['family']} ans={row['answer']} got={row['generated'][:70]!r}")
    return r

if a.full:
    run(CacheConfig(policy="full", sinks=a.sinks, window=a.window), "full")
name, _, scorer_name = a.policy.partition(":")
for ratio in [float(x) for x in a.compressions.split(",")]:
    run(CacheConfig(policy=name, compression=ratio, sinks=a.sinks, window=a.window, scorer=scorer_name or "accumulated_attention"),
        f"{a.policy} r={ratio} sinks={a.sinks} window={a.window} oracle={a.oracle}{'+numbers' if a.oracle_numbers else ''}")
