"""Sessions in the client against the real server: `KVpopClient.session()` over HTTP and gRPC
(complete answers and streams), `close_session`, and `kvpop-client chat` keeping one session across
turns, reporting what each turn reused, and closing it when stdin ends."""

from __future__ import annotations

import re
import subprocess
import sys

import numpy as np
import pytest

from e2e.conftest import checkpoint_dir

pytestmark = pytest.mark.server
PROMPT = np.random.default_rng(77).integers(3, 250, 60).tolist()


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_a_client_session_reuses_each_turn_and_closing_forgets_it(kvpop_http, kvpop_grpc, triton_server, protocol):
    client = kvpop_http if protocol == "http" else kvpop_grpc
    with client.session(eviction_policy="full") as session:
        first = session.generate(PROMPT, max_tokens=4, ignore_eos=True)
        second_prompt = PROMPT + first.output_ids + [7, 8]
        second = session.generate(second_prompt, max_tokens=4, ignore_eos=True)
        assert first.tokens_reused == 0 and second.tokens_reused == len(PROMPT) + 3
        third_prompt = second_prompt + second.output_ids + [9]
        third = session.generate(third_prompt, max_tokens=4, ignore_eos=True)
        assert third.tokens_reused == len(second_prompt) + 3
        assert third.output_ids == client.generate(third_prompt, max_tokens=4, ignore_eos=True, eviction_policy="full").output_ids
    sessions_dir = checkpoint_dir(triton_server)
    assert session.closed and not checkpoint_of(sessions_dir, session.id).exists()
    again = client.generate(third_prompt + third.output_ids + [5], max_tokens=2, eviction_policy="full", session_id=session.id)
    assert again.tokens_reused == 0  # closed: forgotten on the server
    client.close_session(session.id)
    with pytest.raises(RuntimeError, match="closed"):
        session.generate(PROMPT, max_tokens=1)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_a_streamed_session_turn_reuses_the_previous_one(kvpop_http, kvpop_grpc, protocol):
    # HTTP streams go through generate_stream: the id travels in the JSON body, not as an input.
    client = kvpop_http if protocol == "http" else kvpop_grpc
    with client.session(eviction_policy="full") as session:
        first = list(session.stream("Let a = 7.", max_tokens=1))[-1].result
        second = list(session.stream("Let a = 7. What is a?", max_tokens=1))[-1].result
    assert first.tokens_reused == 0 and second.tokens_reused == first.num_input_tokens
    assert second.tokens_computed == second.num_input_tokens - first.num_input_tokens > 0


def checkpoint_of(sessions_dir, session_id: str):
    from kvpop.sessions import SessionKey

    return sessions_dir / f"{SessionKey.of(session_id, (sessions_dir / 'session.key').read_bytes()).digest}.safetensors"


def test_session_ids_are_random_and_acceptable_to_the_server():
    from kvpop.sessions import validate_session_id
    from kvpop_client import new_session_id

    ids = {new_session_id() for _ in range(100)}
    assert len(ids) == 100 and all(validate_session_id(session_id) for session_id in ids)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_cli_chat_keeps_one_session_across_turns_and_closes_it_at_the_end(triton_server, protocol):
    url = triton_server.http_url if protocol == "http" else triton_server.grpc_url
    turns = "Let a = 7. What is a?\nAnd b?\nAnd c?\n"
    command = [sys.executable, "-m", "kvpop_client.cli", "--protocol", protocol, "--url", url, "chat",
               "--system", "Be brief.", "--max-tokens", "1", "--policy", "full", "--show-reuse"]
    result = subprocess.run(command, input=turns, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    [session_id] = re.findall(r"\[session (\S+)\]", result.stderr)
    counts = [tuple(map(int, pair)) for pair in re.findall(r"\[tokens reused (\d+), computed (\d+)\]", result.stderr)]
    assert len(counts) == 3 and counts[0][0] == 0, result.stderr
    # One output token per turn, so each turn's saved state is exactly its prompt: the next turn
    # (the same conversation, re-rendered) reuses all of it and computes only the new lines.
    for (reused_before, computed_before), (reused, computed) in zip(counts, counts[1:]):
        assert reused == reused_before + computed_before and computed > 0, counts
    sessions_dir = checkpoint_dir(triton_server)
    assert not checkpoint_of(sessions_dir, session_id).exists()  # closed when stdin ended

    plain = subprocess.run(command + ["--no-session"], input=turns, capture_output=True, text=True, timeout=120)
    assert plain.returncode == 0 and "[session" not in plain.stderr
    assert [int(reused) for reused in re.findall(r"reused (\d+)", plain.stderr)] == [0, 0, 0]
    assert plain.stdout == result.stdout  # the same answers with or without the session (greedy, full)
