"""The multi-turn suite (kvpop_eval.multiturn): seeded chats whose asked fact sits at any turn among facts of
its kind, split apart; turns that continue their session token for token; a resumable run through the
engine's sessions on the tiny exported model; the analysis against the full cache; the pre-registration."""

from __future__ import annotations

import json

import pytest

from kvpop_eval.multiturn import analysis, plan, runner
from kvpop_eval.multiturn.chats import FILLER, ChatShape, answered, filler_split, make_chat
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
        assert users[-1].endswith("?") and not any(value in users[-1] for value in [chat["answer"], *chat["competing"]])
    assert len({chat["fact_turn"] for chat in chats}) == SHAPE.statement_turns  # the asked fact at every turn
    assert {chat["kind"] for chat in chats} == {"number", "city", "person", "password"}


def test_splits_share_no_value_and_no_filler_sentence():
    values = {split: {value for index in range(60) for value in
                      [make_chat(split, index, SHAPE)["answer"], *make_chat(split, index, SHAPE)["competing"]]}
              for split in ("validation", "test")}
    assert not values["validation"] & values["test"] - {value for value in values["test"] if value.isdigit()}
    for split in ("validation", "test"):
        body = " ".join(" ".join(make_chat(split, index, SHAPE)["users"]) for index in range(20))
        assert all(sentence not in body for sentence in FILLER if filler_split(sentence) != split)
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
    shape = ChatShape(statement_turns=3, filler=1, competitors=1, other_facts=0)
    tasks.write_text("".join(json.dumps(make_chat("validation", index, shape)) + "\n" for index in range(3)))
    out = tmp_path / "out"
    settings = dict(reply_tokens=4, answer_tokens=3, model=tiny_onnx_model_dir)
    runner.run("sessions", tasks, ["full", "kvpop", "keep_start"], [0.5], out, **settings)
    rows = runner.read_rows(runner.rows_path(out, "sessions", "kvpop", 0.5))
    assert sorted(rows) == [0, 1, 2] and all(row["cold_turns"] == 0 for row in rows.values())  # every turn continued
    assert all(row["compression"] > 0.3 and len(row["replies"]) == 3 for row in rows.values())
    keep_start = runner.read_rows(runner.rows_path(out, "sessions", "keep_start", 0.5))
    assert all(row["budget"] == rows[index]["budget"] for index, row in keep_start.items())  # one budget per chat
    path = runner.rows_path(out, "sessions", "full", 0.0)
    path.write_text("".join(path.read_text().splitlines(keepends=True)[:2]))  # a run stopped after two chats
    runner.run("sessions", tasks, ["full", "kvpop", "keep_start"], [0.5], out, **settings)
    assert sorted(runner.read_rows(path)) == [0, 1, 2] and len(path.read_text().splitlines()) == 3
    with pytest.raises(ValueError, match="reply_tokens"):
        runner.run("sessions", tasks, ["full"], [0.5], out, reply_tokens=5, answer_tokens=3, model=tiny_onnx_model_dir)
    summary = runner.report(tasks, out, ["full", "kvpop", "keep_start"], [0.5])
    assert summary["complete"] and json.loads((out / "multiturn.json").read_text()) == json.loads(json.dumps(summary))
    results = summary["routes"]["sessions"]["results"]
    assert [row["policy"] for row in results] == ["full", "kvpop", "keep_start"] and "openai" not in summary["routes"]
    assert all(len(row["correct_by_task"]) == 3 for row in results) and "versus_full" in results[1]


def test_the_comparison_with_the_full_cache():
    full, policy = "1111111100", "1111110010"
    figures = analysis.compare({"correct_by_task": policy}, {"correct_by_task": full})
    assert figures["accuracy"] == 0.7 and figures["ratio"] == pytest.approx(7 / 8) and figures["retained"] == 6 / 8
    assert (figures["gained"], figures["lost"]) == (1, 2) and figures["difference"] == pytest.approx(-0.1)
    low, high = figures["ratio_interval"]
    assert low < 7 / 8 < high <= 1.5
    assert figures["retained_interval"][0] < 0.75 < figures["retained_interval"][1]
    assert analysis.compare({"correct_by_task": full}, {"correct_by_task": full})["ratio_interval"] == [1.0, 1.0]
    assert analysis.compare({"correct_by_task": "10"}, {"correct_by_task": "00"})["ratio"] is None


def test_the_test_chats_are_the_preregistered_ones(tmp_path):
    """The generator and its pools have not changed since the test split's pre-registration."""
    path = plan.write_tasks(tmp_path / "chats.jsonl")
    assert len(path.read_text().splitlines()) == plan.TEST.num >= 100
