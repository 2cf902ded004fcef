"""The reference model: a small Llama trained from scratch on kvpop_eval.tasks, shipped in models/reference.

Entry points: `python -m kvpop_train.reference.train` (resumable curriculum training) and
`python -m kvpop_train.reference.evaluate` (full cache vs StreamingLLM accuracy per context length).
"""
