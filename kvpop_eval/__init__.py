"""Evaluation and benchmarks of KVpop Serve, beside the runtime package `kvpop` (never shipped in the image).

english_tasks.py and diverse_tasks.py generate the benchmark tasks (the reference tasks are `kvpop_tasks`,
shared with training), quality/ measures accuracy under every policy, reference_model.py the reference model,
kvpress_compare.py runs NVIDIA kvpress on the same tasks, bench/ times the decoder, the engine and the
service, timing.py is their one timing loop. Run from the repository root: `python -m kvpop_eval.<tool>`.
"""
