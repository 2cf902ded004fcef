"""Multi-turn chats under a bounded cache: a fact given in the first user turn is asked many turns later,
each turn continuing the conversation's session (`session_id`: the engine keeps the cache between turns,
as the service does), against the full cache.

    python -m kvpop_eval.multiturn write --split validation --num 24 --turns 12 --out FILE.jsonl
    python -m kvpop_eval.multiturn run --model EXPORT_DIR --tasks FILE.jsonl --policies full,kvpop:mlstm \
        --compressions 0.88 --out-dir DIR

A conversation: the first user turn tells the assistant a personal fact (a locker code, or the city a
sister works in: numbers and names drawn from the split's share of kvpop_eval.english_tasks' pools, so no
two splits share one); `--turns` - 2 turns then tell it other things about the user's life, one a turn
(the fact asked for competes with many of its kind); the last asks for the fact, and the answer's first
words are sent with it ("Your locker code at the gym is"), as a client may: SmolLM2-135M's full cache
otherwise answers such a question late in a chat with a refusal or with the latest turn's topic. The
assistant's replies are the model's own (greedy, `--reply-tokens` at most), so every policy holds its
own conversation, as a user would have it.

The cache of a bounded policy has one budget for the whole conversation (a session keeps its cache
only under the budget it was saved with): `ceil((1 - r) * N)` slots per head, N the conversation's
tokens when every reply takes its `--reply-tokens`; the compression reached at the last turn is reported.
A turn's prompt is the previous turn's tokens, its reply's and the new user turn's (the chat template's
markers between), so the session always continues; a turn that did not is counted (`cold_turns`).
Scoring is `contains`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import sys
import time
from pathlib import Path

from kvpop_eval.english_tasks import SPLITS, _JOBS, _number, _pool, haystack_paragraphs

# The filler turns: other things a user tells the assistant about their life, one a turn, so the fact
# asked for competes with many of its kind (a chat, not a needle in unrelated text).
NOTES = (
    "My favourite colour is green.",
    "I have a dog called Pepper.",
    "My flight to Lisbon leaves on a Tuesday.",
    "I am learning to play the cello.",
    "My brother lives near the sea.",
    "I usually drink tea in the morning.",
    "My car is a small red hatchback.",
    "I started a vegetable garden this spring.",
    "My best friend is a nurse.",
    "I run five kilometres every Sunday.",
    "My apartment is on the fourth floor.",
    "I am reading a novel about sailors.",
    "My grandmother turns ninety next month.",
    "I prefer trains to planes.",
)


def make_conversation(split: str, index: int, turns: int) -> dict:
    """One conversation's user turns (the first holds the fact), its question and answer."""
    if turns < 3:
        raise ValueError(f"a conversation needs at least 3 turns (fact, filler, question), got {turns}")
    rng = random.Random(f"multiturn:{split}:{index}")
    if index % 2 == 0:
        code = _number(rng)
        fact = f"My locker code at the gym is {code}. Please remember it, I will ask you for it later."
        question, answer, opening = "What is my locker code at the gym?", code, "Your locker code at the gym is"
    else:
        name, city = rng.choice(_pool("person", split)), rng.choice(_pool("city", split))
        job = rng.choice(_JOBS)
        fact = f"My sister {name} works as a {job} in the city of {city}. Please remember it, I will ask you about her later."
        question, answer, opening = "In which city does my sister work?", city, f"Your sister {name} works in the city of"
    users = [fact]
    users += [f"{note} Just so you know." for note in rng.sample(NOTES, turns - 2)]
    users.append(question)
    return {"split": split, "index": index, "turns": turns, "users": users, "answer": answer, "fact": fact, "opening": opening}


def write(out: Path, split: str, num: int, turns: int) -> list[dict]:
    records = [make_conversation(split, index, turns) for index in range(num)]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(record) + "\n" for record in records))
    return records


class TurnTokens:
    """Token ids of a conversation's turns in the model's chat template, built so that each turn's prompt
    continues the previous prompt and reply token for token (a session then always continues)."""

    def __init__(self, tokenizer) -> None:
        from kvpop.serving.kvpop_engine.chat import render_chat

        self.tokenizer, self.render = tokenizer, render_chat
        one = [{"role": "user", "content": "A"}, {"role": "assistant", "content": "B"}]
        closed = render_chat(one, tokenizer, add_generation_prompt=False)
        opened = render_chat([*one, {"role": "user", "content": "\x00"}], tokenizer)
        if not opened.startswith(closed):
            raise ValueError("the chat template renders an earlier turn differently once a turn follows")
        self.after_reply = closed[closed.rindex("B") + 1 :]  # e.g. "<|im_end|>\n"
        self.user_turn = opened[len(closed) :].split("\x00")  # text before and after a user turn's content
        self.eos = tokenizer.eos_token_id
        eos_text = tokenizer.decode([self.eos]) if self.eos is not None else ""
        self.after_eos = self.after_reply[len(eos_text) :] if eos_text and self.after_reply.startswith(eos_text) else self.after_reply

    def first(self, user: str) -> list[int]:
        text = self.render([{"role": "user", "content": user}], self.tokenizer)
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def next(self, prompt_ids: list[int], output_ids: list[int], user: str) -> list[int]:
        reply = list(output_ids)
        if self.eos is not None and (not reply or reply[-1] != self.eos):
            reply.append(self.eos)  # a reply cut at its token limit is closed as the template closes one
        text = self.after_eos + self.user_turn[0] + user + self.user_turn[1]
        return list(prompt_ids) + reply + self.tokenizer(text, add_special_tokens=False).input_ids


def planned_tokens(turns: TurnTokens, conversation: dict, reply_tokens: int, answer_tokens: int) -> int:
    """The conversation's tokens if every reply takes `reply_tokens`: what the bounded budget is sized by."""
    ids = turns.first(conversation["users"][0])
    for user in conversation["users"][1:]:
        ids = turns.next(ids, [0] * reply_tokens, user)
    return len(ids) + answer_tokens


def run_policy(engine, turns: TurnTokens, conversations: list[dict], policy: str, compression: float,
               reply_tokens: int, answer_tokens: int, scoring, kvpop_options: dict | None = None) -> dict:
    """Every conversation under one policy, all turns k of all conversations in one batch. `kvpop_options`:
    CacheConfig fields of a kvpop cache (span_pooling, query_window)."""
    from kvpop.request import CacheConfig, GenerationRequest, SamplingParams
    from kvpop_eval.quality.harness import policy_config

    name = policy.partition(":")[0]
    prompts = [turns.first(conversation["users"][0]) for conversation in conversations]
    budgets = [None if name == "full" else math.ceil((1 - compression) * planned_tokens(turns, c, reply_tokens, answer_tokens))
               for c in conversations]
    tag = hashlib.sha256(f"{policy}:{compression}:{time.time()}".encode()).hexdigest()[:8]
    cold, results, started = 0, [], time.perf_counter()
    count = len(conversations[0]["users"])
    for turn in range(count):
        last = turn == count - 1
        requests = []
        for index, (conversation, prompt, budget) in enumerate(zip(conversations, prompts, budgets)):
            cache = CacheConfig(policy="full") if name == "full" else policy_config(policy, None, kvpop_options=kvpop_options, budget=budget)
            sampling = SamplingParams(max_tokens=answer_tokens if last else reply_tokens)
            requests.append(GenerationRequest(f"{tag}-{index}-{turn}", prompt, sampling, cache,
                                              session_id=f"{tag}-{index}", end_session=last))
        results = engine.generate(requests)
        cold += sum(turn > 0 and result.tokens_reused == 0 for result in results)
        if not last:
            prompts = [turns.next(prompt, result.output_ids, conversation["users"][turn + 1])
                       for prompt, result, conversation in zip(prompts, results, conversations)]
            if turn + 1 == count - 1:  # the question's answer starts with its opening words, as a client may send them
                prompts = [prompt + turns.tokenizer(conversation["opening"], add_special_tokens=False).input_ids
                           for prompt, conversation in zip(prompts, conversations)]
        print(f"  {policy} @ {compression:.0%}: turn {turn + 1}/{count} done ({time.perf_counter() - started:.0f} s)", flush=True)
    rows = []
    for conversation, result in zip(conversations, results):
        text = engine.tokenizer.decode(result.output_ids, skip_special_tokens=True)
        rows.append({"index": conversation["index"], "answer": conversation["answer"], "generated": text,
                     "correct": bool(scoring(text, conversation["answer"])), "tokens_seen": result.tokens_seen,
                     "budget": result.budget, "compression": result.compression, "peak_kv_bytes": result.peak_kv_bytes})
    count = len(rows)
    # The quality sweep's row format (kvpop_eval.quality.report.summary_row), so the docs render it the same way.
    return {"policy": policy, "compression": 0.0 if name == "full" else compression, "tasks": count,
            "accuracy": sum(row["correct"] for row in rows) / count,
            "compression_achieved": sum(row["compression"] for row in rows) / count,
            "mean_budget": sum(row["budget"] for row in rows) / count,
            "max_peak_kv_bytes": max(row["peak_kv_bytes"] for row in rows),
            "mean_tokens": sum(row["tokens_seen"] for row in rows) / count, "cold_turns": cold,
            "seconds": time.perf_counter() - started,
            "correct_by_task": "".join("1" if row["correct"] else "0" for row in rows), "rows": rows}


def run(model: Path, tasks: Path, policies: list[str], compressions: list[float], out_dir: Path,
        reply_tokens: int, answer_tokens: int, kvpop_options: dict | None = None) -> dict:
    from kvpop.sessions import SessionStore, TierLimits, model_fingerprint
    from kvpop_eval.engine_factory import build_engine
    from kvpop_eval.provenance import stamp
    from kvpop_eval.quality.tasks_io import scorer

    conversations = [json.loads(line) for line in tasks.read_text().splitlines() if line.strip()]
    sessions = SessionStore(TierLimits(hot_bytes=4 << 30, warm_bytes=0), model_fingerprint(model))
    engine = build_engine(model, sessions=sessions, max_batch_size=8)
    turns = TurnTokens(engine.tokenizer)
    report = stamp({"tasks": len(conversations), "scoring": "contains", "tasks_file": str(tasks),
                    "tasks_sha256": hashlib.sha256(tasks.read_bytes()).hexdigest(),
                    "turns": len(conversations[0]["users"]), "reply_tokens": reply_tokens, "answer_tokens": answer_tokens,
                    "kvpop_options": kvpop_options or {}, "results": []})
    out_dir.mkdir(parents=True, exist_ok=True)
    for policy in policies:
        for ratio in ([0.0] if policy == "full" else compressions):
            row = run_policy(engine, turns, conversations, policy, ratio, reply_tokens, answer_tokens, scorer("contains"), kvpop_options)
            report["results"].append(row)
            (out_dir / "multiturn.json").write_text(json.dumps(report, indent=2) + "\n")
            print(f"{policy} @ {ratio:.0%}: {row['accuracy']:.3f} of {row['tasks']} conversations, compression "
                  f"{row['compression_achieved']:.3f}, {row['cold_turns']} cold turns, {row['seconds']:.0f} s", flush=True)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvpop_eval.multiturn", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    writer = commands.add_parser("write", help="write a split's conversations as JSONL")
    writer.add_argument("--split", choices=SPLITS, default="test")
    writer.add_argument("--num", type=int, default=24)
    writer.add_argument("--turns", type=int, default=8, help="user turns, the fact's and the question's included")
    writer.add_argument("--out", type=Path, required=True)
    runner = commands.add_parser("run", help="every policy x compression on the conversations")
    runner.add_argument("--model", type=Path, required=True, help="exported model directory")
    runner.add_argument("--tasks", type=Path, required=True)
    runner.add_argument("--policies", default="full,kvpop:mlstm")
    runner.add_argument("--compressions", default="0.88")
    runner.add_argument("--reply-tokens", type=int, default=24)
    runner.add_argument("--answer-tokens", type=int, default=16)
    runner.add_argument("--span-pooling", default=None, help="kvpop: as kvpop_eval.quality --span-pooling")
    runner.add_argument("--query-window", type=int, default=None, help="kvpop: as kvpop_eval.quality --query-window")
    runner.add_argument("--out-dir", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.command == "write":
        records = write(args.out, args.split, args.num, args.turns)
        print(f"wrote {len(records)} {args.split} conversations of {args.turns} user turns to {args.out}")
        return 0
    policies = [name.strip() for name in args.policies.split(",") if name.strip()]
    kvpop_options = {name: value for name, value in (("span_pooling", args.span_pooling), ("query_window", args.query_window))
                     if value is not None}
    run(args.model, args.tasks, policies, [float(r) for r in args.compressions.split(",")], args.out_dir,
        args.reply_tokens, args.answer_tokens, kvpop_options)
    return 0


if __name__ == "__main__":
    sys.exit(main())
