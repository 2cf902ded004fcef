"""Chats through the engine's sessions, as the service runs them: every turn names the chat's `session_id`,
so the engine starts from the cache it kept after the previous turn and prefills only the new tokens.

The engine is the service's (`ServiceConfig` defaults: a turn's new tokens enter whole, kvpop's question
picks at every turn) and each cache is the one the service gives a request naming the policy
(`request_cache_config`). A session keeps its cache only under the budget it was saved with, so a bounded
chat has one budget from its first turn on: `ceil((1 - r) * N)` slots per head, N the chat's tokens when
every reply takes `reply_tokens` (the compression reached at the answer is reported). A turn that did not
continue its session is counted (`cold_turns`).
"""

from __future__ import annotations

import hashlib
import math
import time
from pathlib import Path
from typing import Callable

from kvpop.request import GenerationRequest, SamplingParams
from kvpop.serving.kvpop_engine.config import ServiceConfig
from kvpop.serving.kvpop_engine.parse import request_cache_config
from kvpop_eval.multiturn.chats import answered
from kvpop_eval.multiturn.turns import TurnTokens

SERVICE = ServiceConfig()


def build_session_engine(model: Path):
    """The service's engine over `model`, with a session store that keeps every chat in memory."""
    from kvpop.sessions import SessionStore, TierLimits, model_fingerprint
    from kvpop_eval.engine_factory import build_engine

    sessions = SessionStore(TierLimits(hot_bytes=4 << 30, warm_bytes=0), model_fingerprint(model))
    return build_engine(model, sessions=sessions, **vars(SERVICE.engine_config()))


def run_chats(engine, chats: list[dict], policy: str, compression: float, reply_tokens: int, answer_tokens: int,
              on_row: Callable[[dict], None]) -> None:
    """`chats` under one policy, a batch of the engine's size at a time (all its turns k in one call);
    `on_row(row)` as each batch's chats end."""
    turns = TurnTokens(engine.tokenizer)
    size = engine.config.max_batch_size
    for start in range(0, len(chats), size):
        batch = chats[start : start + size]
        budgets = [None if policy == "full" else math.ceil((1 - compression) * turns.planned(chat["users"], reply_tokens, answer_tokens, chat.get("system")))
                   for chat in batch]
        caches = [request_cache_config(policy, budget, None, SERVICE) for budget in budgets]
        tag = hashlib.sha256(f"{policy}:{compression}:{start}:{time.time()}".encode()).hexdigest()[:8]
        prompts = [turns.first(chat["users"][0], chat.get("system")) for chat in batch]
        replies: list[list[str]] = [[] for _ in batch]
        cold = [0] * len(batch)
        count = len(batch[0]["users"])
        for turn in range(count):
            last = turn == count - 1
            sampling = SamplingParams(max_tokens=answer_tokens if last else reply_tokens)
            requests = [GenerationRequest(f"{tag}-{index}-{turn}", prompt, sampling, cache, session_id=f"{tag}-{index}", end_session=last)
                        for index, (prompt, cache) in enumerate(zip(prompts, caches))]
            results = engine.generate(requests)
            for index, result in enumerate(results):
                cold[index] += turn > 0 and result.tokens_reused == 0
                replies[index].append(engine.tokenizer.decode(result.output_ids, skip_special_tokens=True))
            if not last:
                prompts = [turns.next(prompt, result.output_ids, chat["users"][turn + 1])
                           for prompt, result, chat in zip(prompts, results, batch)]
        for chat, result, said, cold_turns in zip(batch, results, replies, cold):
            on_row({"index": chat["index"], "correct": answered(said[-1], chat), "generated": said[-1], "replies": said[:-1],
                    "tokens_seen": result.tokens_seen, "budget": result.budget, "compression": result.compression,
                    "peak_kv_bytes": result.peak_kv_bytes, "cold_turns": cold_turns})
