"""The multi-turn suite (kvpop_eval.multiturn): seeded chats whose asked fact sits at any turn among facts of
its kind, split apart (test passages from held-out sources only); turns that continue their session token for
token; a resumable run through the engine's sessions on the tiny exported model; the summary against the full
cache; the pre-registration."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict

import pytest

from kvpop_eval import text_sources
from kvpop_eval.multiturn import plan, runner
from kvpop_eval.multiturn.chats import KINDS, ChatShape, answered, make_chat, subjects
from kvpop_eval.multiturn.turns import TurnTokens

SHAPE = ChatShape()


def test_chats_are_seeded_and_state_the_asked_fact_once_among_facts_of_its_kind():
    chats = [make_chat("validation", index, SHAPE) for index in range(40)]
    assert chats[3] == make_chat("validation", 3, SHAPE)
    for chat in chats:
        users = chat["users"]
        assert len(users) == SHAPE.statement_turns + 1
        stating = [turn for turn, user in enumerate(users) if chat["answer"] in user]
        assert stating == [chat["fact_turn"]]
        assert len(chat["competing"]) == SHAPE.competitors and chat["answer"] not in chat["competing"]
        assert all(sum(value in user for user in users[:-1]) == 1 for value in chat["competing"])
        assert "? Answer with" in users[-1] and not any(value in users[-1] for value in [chat["answer"], *chat["competing"]])
    assert len({chat["fact_turn"] for chat in chats}) == SHAPE.statement_turns  # the asked fact at every turn
    assert {chat["kind"] for chat in chats} == set(KINDS)


def test_splits_share_no_subject_value_or_passage_source():
    chats = {split: [make_chat(split, index, SHAPE) for index in range(60)] for split in ("validation", "test")}
    values = {split: {value for chat in found for value in [chat["answer"], *chat["competing"]] if not value.isdigit()}
              for split, found in chats.items()}
    assert not values["validation"] & values["test"]
    for kind in KINDS:
        assert not set(subjects(kind, "validation")) & set(subjects(kind, "test"))
    test_text = " ".join(user for chat in chats["test"] for user in chat["users"])
    for source in ("reference", "readme", "chat"):  # validation's sources: no test passage comes from them
        assert not any(block[:120] in test_text for block in text_sources.blocks(source, "test"))
    assert any(block[:80] in test_text for source in text_sources.HELD_OUT for block in text_sources.blocks(source, "test"))
    with pytest.raises(ValueError, match="splits"):
        make_chat("train", 0, SHAPE)


def test_an_answer_counts_only_without_a_competing_value():
    chat = {"answer": "Yartor", "competing": ["Fenbo", "Vexwen"]}
    assert answered("Your sister works in yartor.", chat)
    assert not answered("Your sister works in Yartor or Fenbo.", chat)
    assert not answered("I do not know.", chat)


def test_each_turn_continues_the_previous_prompt_and_reply(tiny_onnx_model_dir):
    from kvpop_eval.engine_factory import build_engine

    turns = TurnTokens(build_engine(tiny_onnx_model_dir).tokenizer)
    first = turns.first("My locker code is 123456.")
    reply = [5, 6, 7]
    second = turns.next(first, reply, "Thanks.")
    assert second[: len(first) + len(reply)] == first + reply and len(second) > len(first) + len(reply) + 1
    assert turns.planned(["a", "b"], reply_tokens=4, answer_tokens=3) == len(turns.next(turns.first("a"), [0] * 4, "b")) + 3


def test_a_session_run_continues_every_session_writes_a_row_per_chat_and_resumes(tiny_onnx_model_dir, tmp_path):
    tasks = tmp_path / "chats.jsonl"
    shape = ChatShape(statement_turns=3, passage_chars=60, competitors=1, other_facts=0)
    tasks.write_text("".join(json.dumps(make_chat("validation", index, shape)) + "\n" for index in range(3)))
    out = tmp_path / "out"
    settings = dict(reply_tokens=4, answer_tokens=3, model=tiny_onnx_model_dir)
    cells = runner.cells_of(["full", "kvpop", "keep_start"], [0.5])
    runner.run("sessions", tasks, cells, out, chunk=2, **settings)
    rows = runner.read_rows(runner.rows_path(out, "sessions", "kvpop", 0.5))
    assert sorted(rows) == [0, 1, 2] and all(row["cold_turns"] == 0 for row in rows.values())  # every turn continued
    assert all(row["compression"] > 0.3 and len(row["replies"]) == 3 for row in rows.values())
    keep_start = runner.read_rows(runner.rows_path(out, "sessions", "keep_start", 0.5))
    assert all(row["budget"] == rows[index]["budget"] for index, row in keep_start.items())  # one budget per chat
    path = runner.rows_path(out, "sessions", "full", 0.0)
    path.write_text("".join(path.read_text().splitlines(keepends=True)[:2]))  # a run stopped after two chats
    runner.run("sessions", tasks, cells, out, **settings)
    assert sorted(runner.read_rows(path)) == [0, 1, 2] and len(path.read_text().splitlines()) == 3
    with pytest.raises(ValueError, match="reply_tokens"):
        runner.run("sessions", tasks, [("full", 0.0)], out, reply_tokens=5, answer_tokens=3, model=tiny_onnx_model_dir)
    summary = runner.report(tasks, out, cells)
    assert summary["all_chats_ran"] and json.loads((out / "multiturn.json").read_text()) == json.loads(json.dumps(summary))
    results = summary["routes"]["sessions"]["results"]
    assert [row["policy"] for row in results] == ["full", "kvpop", "keep_start"] and "openai" not in summary["routes"]
    assert all(len(row["correct_by_task"]) == 3 for row in results) and "versus_full" in results[1]


def test_a_summary_reports_the_chats_run_so_far_in_order(tmp_path):
    tasks = tmp_path / "chats.jsonl"
    tasks.write_text("".join(json.dumps({"index": index, "shape": {}}) + "\n" for index in range(4)))
    out = tmp_path / "out"
    runner.check_settings(out, {"tasks_sha256": runner.sha256(tasks), "reply_tokens": 4, "answer_tokens": 3})
    row = {"generated": "", "compression": 0.5, "budget": 8, "peak_kv_bytes": 1, "tokens_seen": 16}
    for (policy, ratio), answers in {("full", 0.0): [1, 1, 1, 0], ("kvpop", 0.88): [1, 0, None, 1]}.items():
        path = runner.rows_path(out, "sessions", policy, ratio)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps({**row, "index": index, "correct": bool(answer)}) + "\n"
                                for index, answer in enumerate(answers) if answer is not None))
    summary = runner.report(tasks, out, [("full", 0.0), ("kvpop", 0.88)])
    full, kvpop = summary["routes"]["sessions"]["results"]
    assert not summary["all_chats_ran"] and full["tasks"] == 4 and kvpop["tasks"] == 2  # chat 3 ran, chat 2 not yet: not counted
    assert kvpop["versus_full"]["tasks"] == 2 and kvpop["versus_full"]["ratio"] == 0.5 and kvpop["versus_full"]["lost"] == 1


def test_a_plan_writes_its_registered_chats_and_refuses_others(tmp_path):
    """A plan regenerates its chats and runs only those whose sha256 it registered."""
    shape = ChatShape(statement_turns=3, passage_chars=80, competitors=1, other_facts=1)
    text = plan.chats_text("test", 3, shape)
    registered = {"tasks": {"path": str(tmp_path / "chats.jsonl"), "split": "test", "num": 3, "shape": asdict(shape),
                            "sha256": hashlib.sha256(text.encode()).hexdigest()},
                  "policies": ["full", "kvpop", "keep_start"], "compressions": [0.88, 0.94]}
    assert plan.write_tasks(registered).read_text() == text
    assert plan.all_cells(registered) == [("full", 0.0), ("kvpop", 0.88), ("kvpop", 0.94), ("keep_start", 0.88), ("keep_start", 0.94)]
    registered["tasks"]["num"] = 4
    with pytest.raises(ValueError, match="not the registered"):
        plan.write_tasks(registered)
