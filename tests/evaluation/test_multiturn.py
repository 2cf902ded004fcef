"""The multi-turn suite (kvpop_eval.multiturn): seeded conversations per split, turns that continue their
session token for token, and a run on the tiny exported model where every turn after the first
continues the session's saved cache."""

from __future__ import annotations

import json

from kvpop_eval.multiturn import TurnTokens, make_conversation, run, write


def test_conversations_are_seeded_split_apart_and_end_with_the_question():
    conversation = make_conversation("validation", 3, 6)
    assert conversation == make_conversation("validation", 3, 6)
    assert len(conversation["users"]) == 6 and conversation["answer"] in conversation["users"][0]
    assert not any(conversation["answer"] in user for user in conversation["users"][1:])
    others = {make_conversation(split, 3, 6)["answer"] for split in ("train", "validation", "test")}
    assert len(others) == 3


def test_each_turn_continues_the_previous_prompt_and_reply(tiny_onnx_model_dir):
    from kvpop_eval.engine_factory import build_engine

    turns = TurnTokens(build_engine(tiny_onnx_model_dir).tokenizer)
    first = turns.first("My locker code is 123456.")
    reply = [5, 6, 7]
    second = turns.next(first, reply, "Thanks.")
    assert second[: len(first) + len(reply)] == first + reply and len(second) > len(first) + len(reply) + 1


def test_a_run_continues_every_session_and_reports_rows_like_a_sweep(tiny_onnx_model_dir, tmp_path):
    tasks = tmp_path / "chats.jsonl"
    write(tasks, "test", 2, 3)
    report = run(tiny_onnx_model_dir, tasks, ["full", "kvpop:mlstm"], [0.5], tmp_path / "out", reply_tokens=4, answer_tokens=3,
                 kvpop_options={"query_window": 4})  # every turn's question picks (the tiny scorer ranks no spans)
    assert json.loads((tmp_path / "out" / "multiturn.json").read_text()) == report
    full, kvpop = report["results"]
    assert full["policy"] == "full" and kvpop["policy"] == "kvpop:mlstm" and kvpop["compression"] == 0.5
    assert full["cold_turns"] == 0 and kvpop["cold_turns"] == 0  # turns 2 and 3 continued their sessions
    assert kvpop["compression_achieved"] > 0.3 and full["compression_achieved"] == 0.0
    assert len(kvpop["correct_by_task"]) == 2 and report["tasks"] == 2
