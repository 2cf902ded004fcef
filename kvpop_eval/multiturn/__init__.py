"""Multi-turn chats under a bounded cache: a fact stated at a random turn among facts of its kind, asked
plainly at the end, through the engine's sessions and through the OpenAI-compatible API.

    python -m kvpop_eval.multiturn write --split validation --num 16 --out FILE.jsonl
    python -m kvpop_eval.multiturn run --route sessions --tasks FILE.jsonl \\
        --policies full,kvpop,keep_start --compressions 0.88,0.94 --out-dir DIR      # resumes
    python -m kvpop_eval.multiturn test [--plan docs/results/preregistration-multiturn.json]   # a registered plan
    python -m kvpop_eval.multiturn summary [--plan ...]                                       # its chats run so far

chats.py makes the chats, turns.py their token ids turn by turn, session_route.py and openai_route.py hold
them, runner.py keeps one row per chat (a run resumes) and summarises against the full cache
(kvpop_eval.quality.analysis), plan.py runs a registered test plan.
"""
