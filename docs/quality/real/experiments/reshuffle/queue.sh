#!/bin/bash
# Session 21 CPU queue: validation replay on the reshuffled multikey tasks, then the test split's multikey tasks.
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
echo "$(date +%T) 2k kvpress start"
until [ -f .venv-kvpress/.kvpress-setup ]; do sleep 10; done
.venv-kvpress/bin/python -m benchmarks.kvpress_compare run --model models/smollm2-135m-instruct --tasks build/real-tasks/test-2048-mk6.jsonl \
  --out $R/kvpress-2048-mk6.json --scoring contains --max-tokens 32 --threads 2 --variants prefill > $R/kvpress-2048-mk6.log 2>&1
echo "$(date +%T) 4k engine start"
.venv/bin/python -m kvpop.eval --model model_repository/kvpop_engine/1 --tasks build/real-tasks/test-4096-mk6.jsonl --sweep \
  --scoring contains --max-tokens 32 --window 64 --policies kvpop:mlstm,streaming,kvpop:mlp,h2o,tova,random,kvpop \
  --out-dir $R/test-4096-mk6 > $R/test-4096-mk6.log 2>&1
echo "$(date +%T) 4k kvpress start"
.venv-kvpress/bin/python -m benchmarks.kvpress_compare run --model models/smollm2-135m-instruct --tasks build/real-tasks/test-4096-mk6.jsonl \
  --out $R/kvpress-4096-mk6.json --scoring contains --max-tokens 32 --threads 2 --variants prefill > $R/kvpress-4096-mk6.log 2>&1
echo "$(date +%T) done"
