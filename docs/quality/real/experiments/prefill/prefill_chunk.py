"""Session 20 probe (validation split only): what prefill under eviction costs.

    python docs/quality/real/experiments/prefill/prefill_chunk.py --model model_repository/kvpop_engine/1 \
        --tasks build/real-tasks/val-2048-pk96.jsonl --limit 24 --prefill-chunk 4096 --sweep --scoring contains \
        --max-tokens 32 --window 64 --policies kvpop:mlstm --compressions 0.75,0.88 --skip-full --out-dir DIR

`python -m kvpop.eval` with every prompt chunk `--prefill-chunk` tokens long whatever the budget (the engine
caps a bounded cache's chunk at max(budget, min_bounded_chunk), so that no query sees more than budget + chunk
tokens). A chunk longer than the prompt prefills it with full attention and evicts down to the budget
once, after it: the kvpress setting (compress after prefill), with the transient memory of the whole prompt.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[5]))

from kvpop import engine as engine_module  # noqa: E402
from kvpop import eval as evaluation  # noqa: E402

if __name__ == "__main__":
    engine_module.Engine._chunk_size = lambda self, budget: self.prefill_chunk
    evaluation.main(sys.argv[1:])
