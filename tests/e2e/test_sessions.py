"""Sessions against the real server: a conversation continued from the server's saved state equals
sending the whole history (full cache, greedy), reuses >= 95% of its context from turn 3 on, survives
SIGKILL of the server, spills to disk past the memory tiers, and hostile ids are refused."""

from __future__ import annotations

import numpy as np
import pytest

from kvpop_client import KVpopServerError

from e2e.conftest import checkpoint_dir, wait_for_checkpoint

pytestmark = pytest.mark.server
TURNS = 10
REPLY = 12


def user_turn(turn: int) -> list[int]:
    rng = np.random.default_rng(500 + turn)
    return rng.integers(3, 250, 120 if turn == 0 else 3).tolist()  # a long first turn (a system prompt)


def conversation(client, session_id: str | None, turns: int = TURNS, **options):
    history: list[int] = []
    results = []
    for turn in range(turns):
        prompt = history + user_turn(turn)
        result = client.generate(prompt, max_tokens=REPLY, ignore_eos=True, session_id=session_id, **options)
        results.append(result)
        history = prompt + result.output_ids
    return results


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_ten_turns_equal_the_whole_history_and_reuse_95_percent(kvpop_grpc, kvpop_http, metrics, protocol):
    client = kvpop_grpc if protocol == "grpc" else kvpop_http
    before = metrics("kvpop_session_tokens_reused_total"), metrics("kvpop_session_prompt_tokens_total")
    with_session = conversation(client, f"ten-turns-{protocol}")
    without = conversation(client, None)
    for turn, (a, b) in enumerate(zip(with_session, without)):
        assert a.output_ids == b.output_ids, f"turn {turn}"
        assert b.tokens_reused == 0 and b.tokens_computed == b.num_input_tokens
        assert a.tokens_reused + a.tokens_computed == a.num_input_tokens
        if turn >= 2:
            assert a.tokens_reused / a.num_input_tokens >= 0.95, f"turn {turn}: {a.tokens_reused}/{a.num_input_tokens}"
    reused = metrics("kvpop_session_tokens_reused_total") - before[0]
    prompt = metrics("kvpop_session_prompt_tokens_total") - before[1]
    assert reused == sum(a.tokens_reused for a in with_session) and prompt == sum(a.num_input_tokens for a in with_session)


def test_a_bounded_session_continues_and_reports_the_whole_conversation(kvpop_grpc):
    results = conversation(kvpop_grpc, "bounded", turns=4, eviction_policy="streaming", kv_budget=64)
    for turn, result in enumerate(results[1:], start=1):
        assert result.tokens_reused == results[turn - 1].num_input_tokens + REPLY - 1
        assert result.kv_budget == 64 and result.tokens_evicted > 0


def test_session_close_forgets_the_session(kvpop_grpc):
    first = kvpop_grpc.generate(user_turn(0), max_tokens=4, ignore_eos=True, session_id="closing")
    prompt = user_turn(0) + first.output_ids + [7]
    last = kvpop_grpc.generate(prompt, max_tokens=4, ignore_eos=True, session_id="closing", session_close=True)
    assert last.tokens_reused > 0
    again = kvpop_grpc.generate(prompt + last.output_ids + [7], max_tokens=4, ignore_eos=True, session_id="closing")
    assert again.tokens_reused == 0


@pytest.mark.parametrize("hostile", ["../../etc/passwd", "a" * 129, "a b", "ünï", "x;rm"])
def test_hostile_session_ids_are_refused_and_the_server_stays_up(kvpop_http, kvpop_grpc, hostile):
    for client in (kvpop_http, kvpop_grpc):
        with pytest.raises(KVpopServerError, match="session_id"):
            client.generate([1, 2, 3], max_tokens=2, session_id=hostile)
    assert kvpop_grpc.generate([1, 2, 3], max_tokens=2).finish_reason in ("stop", "length")


def test_sessions_beyond_memory_go_to_disk_and_come_back(kvpop_grpc, metrics, triton_server):
    # The test server's hot tier is 0 MiB and its warm tier 1 GiB; every turn is checkpointed.
    names = [f"many-{index}" for index in range(6)]
    first = {name: kvpop_grpc.generate(user_turn(0), max_tokens=4, ignore_eos=True, session_id=name) for name in names}
    sessions_dir = checkpoint_dir(triton_server)
    for name in names:
        wait_for_checkpoint(sessions_dir, name, len(user_turn(0)) + 3)
    assert len(list(sessions_dir.glob("*.safetensors"))) >= len(names)
    assert not any(name in path.name for name in names for path in sessions_dir.iterdir())
    for name in names:
        follow = kvpop_grpc.generate(user_turn(0) + first[name].output_ids + [9], max_tokens=4, ignore_eos=True, session_id=name)
        assert follow.tokens_reused == len(user_turn(0)) + 3


def test_corrupt_checkpoint_is_refused_and_the_turn_prefills_cold(kvpop_grpc, triton_server, metrics):
    first = kvpop_grpc.generate(user_turn(0), max_tokens=4, ignore_eos=True, session_id="to-corrupt")
    sessions_dir = checkpoint_dir(triton_server)
    rejected = metrics("kvpop_session_checkpoints_rejected_total")
    newest = wait_for_checkpoint(sessions_dir, "to-corrupt", len(user_turn(0)) + 3)
    newest.write_bytes(newest.read_bytes()[:200])  # the memory copy is stale now: the disk is read and refused
    follow = kvpop_grpc.generate(user_turn(0) + first.output_ids + [9], max_tokens=4, ignore_eos=True, session_id="to-corrupt")
    assert follow.finish_reason == "length" and follow.tokens_reused == 0
    import time

    time.sleep(1.5)  # session metrics are read from the store at most once a second, on a step,
    kvpop_grpc.generate([1, 2], max_tokens=1)  # after that step's answers: the next request's answer
    kvpop_grpc.generate([1, 2], max_tokens=1)  # comes after the read
    assert metrics("kvpop_session_checkpoints_rejected_total") == rejected + 1


def test_from_a_read_only_repository_a_restart_after_sigkill_continues_every_checkpointed_session(tmp_path, tiny_onnx_model_dir):
    """Served from a read-only model repository: the checkpoints go to the state directory, where a
    restarted server finds them; the repository is left exactly as it was."""
    import os
    import stat

    from kvpop_client import KVpopClient
    from kvpop.serving.process.tritonserver import TritonServer, free_port

    from e2e.conftest import TEST_ENGINE_PARAMETERS
    from export.repository import assemble_model_repository

    root = assemble_model_repository(tmp_path / "models", tiny_onnx_model_dir, TEST_ENGINE_PARAMETERS)
    for path in [root, *root.rglob("*")]:  # as a `:ro` volume or an image layer would be
        path.chmod(path.stat().st_mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))

    def tree() -> dict[str, tuple[int, int] | None]:
        """Every path with each file's size and time (Python's own cache left out: it skips a read-only folder)."""
        return {str(path.relative_to(root)): (path.stat().st_size, path.stat().st_mtime_ns) if path.is_file() else None
                for path in root.rglob("*") if "__pycache__" not in path.parts}

    before_serving = tree()

    def server() -> TritonServer:
        return TritonServer(model_repository=root, http_port=free_port(), grpc_port=free_port(),
                            metrics_port=free_port(), address="127.0.0.1", model_config_name="cpu",
                            log_file=tmp_path / "triton.log", state_dir=tmp_path / "state")

    try:
        first = server()
        with first:
            with KVpopClient(first.grpc_url, "grpc") as client:
                before = {name: conversation(client, name, turns=2) for name in ("k1", "k2")}
            # A checkpoint is on disk a few milliseconds after its turn's response (the store's writer
            # thread); a SIGKILL before that would lose only that turn's (the session would go on from turn 1's).
            for name, results in before.items():
                history = user_turn(0) + results[0].output_ids + user_turn(1) + results[1].output_ids
                wait_for_checkpoint(checkpoint_dir(first), name, len(history) - 1)
            first.process.kill()  # SIGKILL: no shutdown hook runs
            first.process.wait()
            first.kill_leftovers()
        with server() as second, KVpopClient(second.grpc_url, "grpc") as client:
            for name, results in before.items():
                history = user_turn(0) + results[0].output_ids + user_turn(1) + results[1].output_ids
                prompt = history + user_turn(2)
                resumed = client.generate(prompt, max_tokens=REPLY, ignore_eos=True, session_id=name)
                cold = client.generate(prompt, max_tokens=REPLY, ignore_eos=True)
                assert resumed.output_ids == cold.output_ids
                assert resumed.tokens_reused == len(history) - 1
        assert tree() == before_serving
    finally:
        for path in [root, *root.rglob("*")]:
            os.chmod(path, path.stat().st_mode | stat.S_IWUSR)  # so that pytest can remove it
