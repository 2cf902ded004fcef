"""Multi-turn chats under a bounded cache: a fact stated at a random turn among facts of its kind, asked
plainly at the end, through the engine's sessions and through the OpenAI-compatible API.

    python -m kvpop_eval.multiturn write --split validation --num 48 --out FILE.jsonl
    python -m kvpop_eval.multiturn run --route sessions --model EXPORT_DIR --tasks FILE.jsonl \\
        --policies full,kvpop,keep_start,streaming --compressions 0.88,0.94 --out-dir DIR
    python -m kvpop_eval.multiturn test --model EXPORT_DIR --out-dir DIR     # the pre-registered test run

chats.py makes the chats, session_route.py and openai_route.py hold them, runner.py keeps one row per chat
(a run resumes) and summarises, analysis.py compares a policy with the full cache, plan.py is the test
split's pre-registration.
"""
