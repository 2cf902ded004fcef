#!/bin/bash
# Session 21 CPU queue, second part (replaces queue.sh after its 2k engine sweep; no 4k MLP rows).
cd /work/main
R=build/exp-eval/reshuffle
while pgrep -f "test-2048-mk6.jsonl" >/dev/null; do sleep 10; done
echo "$(date +%T) 2k kvpress start"
.venv-kvpress/bin/python -m benchmarks.kvpress_compare run --model models/smollm2-135m-instruct --tasks build/real-tasks/test-2048-mk6.jsonl \
  --out $R/kvpress-2048-mk6.json --scoring contains --max-tokens 32 --threads 2 --variants prefill > $R/kvpress-2048-mk6.log 2>&1
echo "$(date +%T) 4k engine start"
.venv/bin/python -m kvpop.eval --model model_repository/kvpop_engine/1 --tasks build/real-tasks/test-4096-mk6.jsonl --sweep \
  --scoring contains --max-tokens 32 --window 64 --policies kvpop:mlstm,streaming,h2o,tova,random,kvpop \
  --out-dir $R/test-4096-mk6 > $R/test-4096-mk6.log 2>&1
echo "$(date +%T) 4k kvpress start"
.venv-kvpress/bin/python -m benchmarks.kvpress_compare run --model models/smollm2-135m-instruct --tasks build/real-tasks/test-4096-mk6.jsonl \
  --out $R/kvpress-4096-mk6.json --scoring contains --max-tokens 32 --threads 2 --variants prefill > $R/kvpress-4096-mk6.log 2>&1
echo "$(date +%T) pk spot check start"
.venv/bin/python -m kvpop.eval --model model_repository/kvpop_engine/1 --tasks build/real-tasks/test-2048-pk6.jsonl --sweep \
  --scoring contains --max-tokens 32 --window 64 --policies h2o,kvpop --compressions 0.5 --skip-full \
  --out-dir $R/spotcheck-2048-pk6 > $R/spotcheck-2048-pk6.log 2>&1
echo "$(date +%T) done"
