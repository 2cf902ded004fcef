"""Multi-turn chats through the OpenAI-compatible API of the real server (kvpop_eval.multiturn.openai_route):
every turn re-sends the whole conversation, the KVpop controls travel in extra_body."""

from __future__ import annotations

import pytest

from kvpop_eval.multiturn import openai_route
from kvpop_eval.multiturn.chats import ChatShape, make_chat

pytestmark = pytest.mark.server


def test_chats_resend_the_conversation_and_the_server_compresses_each_turn(triton_server, tmp_path):
    chats = [make_chat("validation", index, ChatShape(statement_turns=2, passage_chars=0, competitors=1, other_facts=0)) for index in range(2)]
    rows: dict[str, list[dict]] = {"full": [], "kvpop": [], "keep_start": []}
    with openai_route.started_api(triton_server.grpc_url, tmp_path) as url:
        for policy, found in rows.items():
            openai_route.run_chats(url, chats, policy, 0.5, reply_tokens=4, answer_tokens=3, on_row=found.append)
    for policy, found in rows.items():
        assert sorted(row["index"] for row in found) == [0, 1]
        assert all(len(row["replies"]) == 2 and isinstance(row["correct"], bool) for row in found)
    assert all(row["compression"] == 0.0 for row in rows["full"])
    for policy in ("kvpop", "keep_start"):  # the last turn's whole conversation compressed to half (and its answer)
        assert all(0.3 < row["compression"] < 0.6 and row["budget"] < row["tokens_seen"] for row in rows[policy])
