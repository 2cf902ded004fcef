"""Engine-level benchmarks (Engine.step without Triton, unless a step says otherwise), one entry point:

    python -m kvpop_eval.bench.engine steady   ...   # the bounded cache's steady decode step (make bench-steady)
    python -m kvpop_eval.bench.engine profile  ...   # where an engine step's milliseconds go (make bench-profile)
    python -m kvpop_eval.bench.engine overhead ...   # kvpop's own cost per token over the full cache (make bench-overhead)
"""
