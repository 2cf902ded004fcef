"""The reference model: a small Llama trained from scratch on kvpop.tasks, shipped in models/reference.

Entry points: `python -m kvpop.reference.train` (resumable curriculum training) and
`python -m kvpop.reference.evaluate` (full cache vs StreamingLLM accuracy per context length).
"""
