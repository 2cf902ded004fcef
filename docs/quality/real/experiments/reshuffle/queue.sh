#!/bin/bash
# Session 21 CPU queue, first part: validation replay on the reshuffled multikey tasks, then the 2k test
# split's multikey tasks (after span_rules.py scores on the new validation file).
# Task files: python -m benchmarks.english_tasks write --model models/smollm2-135m-instruct --split test
#   --context-tokens <L> --num 12 --families passkey,multikey --out build/real-tasks/test-<L>-pk12.jsonl (and
#   --split validation --context-tokens 2048 --num 96 for val-2048-pk96.jsonl); the multi-key tasks alone:
#   awk 'NR%2==0' test-<L>-pk12.jsonl > test-<L>-mk6.jsonl (pass keys alone, NR%2==1: test-2048-pk6.jsonl).
#   The files before the shuffle (the old tables' tasks) were kept as build/real-tasks/*.v1.jsonl.
cd /work/main
R=build/exp-eval/reshuffle
while pgrep -f "span_rules.py scores" >/dev/null; do sleep 10; done
echo "$(date +%T) replay start"
.venv/bin/python docs/quality/real/experiments/spans/span_rules.py replay --scores build/exp-eval/span-rules-v2/val-2048-pk96.npz \
  --rules full,linemean@96/48,linectr@384 --compressions 0.75,0.88,0.94 --families multikey \
  --out $R/replay-val-2048-mk48.json > $R/replay.log 2>&1
echo "$(date +%T) 2k engine start"
.venv/bin/python -m kvpop.eval --model model_repository/kvpop_engine/1 --tasks build/real-tasks/test-2048-mk6.jsonl --sweep \
  --scoring contains --max-tokens 32 --window 64 --policies kvpop:mlstm,streaming,kvpop:mlp,h2o,tova,random,kvpop \
  --out-dir $R/test-2048-mk6 > $R/test-2048-mk6.log 2>&1
# The rest (kvpress at 2k, the 4k engine rows without the MLP, kvpress at 4k, a pass-key spot check): queue4.sh.
