"""Evaluation and benchmarks of KVpop Serve, beside the runtime package `kvpop` (never shipped in the image).

tasks/ and english_tasks.py generate the benchmark tasks, quality/ measures accuracy under every policy,
kvpress_compare.py runs NVIDIA kvpress on the same tasks, bench/ times the decoder, the engine and the
service, timing.py is their one timing loop. Run from the repository root: `python -m kvpop_eval.<tool>`.
"""
