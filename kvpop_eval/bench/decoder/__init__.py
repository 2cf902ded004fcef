"""Speed harness (a program, not a test): decode speed and memory of the engine vs Hugging Face.

    python -m kvpop_eval.bench.decoder --out-dir build/results/speed  # builds + exports a random Llama of
                                                               # realistic shape (kvpop_eval/bench/bench_model.py)
    python -m kvpop_eval.bench.decoder --model ONNX_DIR --hf-model HF_DIR --out-dir DIR
    python -m kvpop_eval.bench.decoder --quick --out-dir /tmp/speed    # tiny random model, seconds (plumbing)
    python -m kvpop_eval.bench.decoder --model ONNX_DIR --hf-model HF_DIR --extra-policies kvpop:mlstm,kvpop:mlp \
        --untrained-scorers-dir build/speed-x                  # learned scorers (see 3. below)

1. Decode latency per step and tokens/s vs context length for `full` vs fixed budgets (each bounded
   policy at each budget), at each batch size, and HF `generate` with its default dynamic cache on the
   same model, contexts and batch sizes, in one run (`latency`). Medians over `--decode-steps` timed
   steps after `--warmup-steps` untimed ones. Every context is reached through the engine's public
   API: warm prefixes of one real prefill per cache configuration (`contexts` says why that is the
   state a real prefill leaves).
2. Peak process memory and KV bytes vs generated length for `full` vs bounded policies, each in its
   own process (so peaks do not mix), sampled during one long generation (`memory`).
3. The learned KVpop scorers (`kvpop:mlstm`, `kvpop:mlp` in --policies / --extra-policies; their
   window is the one they were trained for): kvpop's own per-step overhead (kvpop:<kind> minus
   `streaming` at the same budget, which scores nothing), and the scorer call alone
   (`LearnedScorer.score_decode_batch`, what a vectorised decode step runs once per step) per batch
   size (`scorer_cost`). With --untrained-scorers-dir the run times a copy of the model directory made
   there, with an initialised, untrained scorer of the model's shape for each kind the model lacks.
Writes speed.json, decode_speed.png, memory.png (`report`), and prints the speedups at the context
nearest 8k.
"""
