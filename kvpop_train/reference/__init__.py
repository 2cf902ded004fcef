"""The reference model: a small Llama trained from scratch on kvpop_tasks, shipped in models/reference.

Entry point: `python -m kvpop_train.reference.train` (resumable curriculum training); its evaluation (full
cache vs StreamingLLM accuracy per context length) is `python -m kvpop_eval.reference_model`.
"""
