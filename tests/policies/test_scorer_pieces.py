"""A prompt's pieces go through the learned scorer's memory on the scorer's worker thread, beside the
engine's next decoder call: the scores and the memory after them are those of running the pieces in line."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from kvpop.policies.kvpop import load_learned_scorers


@pytest.fixture(scope="module")
def scorer(tiny_onnx_model_dir):
    return load_learned_scorers(tiny_onnx_model_dir)["mlstm"]


def pieces(scorer, lengths: list[int], window: int = 4):
    """Random (new key, new value, leaving positions, leaving key, leaving value) of consecutive pieces."""
    spec = scorer.runtime.spec
    rng = np.random.default_rng(3)
    start = 0
    for length in lengths:
        shape = (spec.num_layers, spec.num_kv_heads, length, spec.head_dim)
        positions = np.arange(start, start + length) - window  # (t,) the token leaving at each row, -1: none
        yield (rng.standard_normal(shape, np.float32), rng.standard_normal(shape, np.float32), np.where(positions >= 0, positions, -1),
               rng.standard_normal(shape, np.float32), rng.standard_normal(shape, np.float32))
        start += length


def test_pieces_run_on_the_worker_and_score_as_in_line(scorer, monkeypatch):
    lengths = [7, 5, 9]
    in_line = scorer.init_state().recurrent
    expected = []
    for new_key, new_value, leaving, leaving_key, leaving_value in pieces(scorer, lengths):
        scores, in_line = scorer.runtime.step(in_line, new_key, new_value, leaving_key, leaving_value, np.zeros(new_key.shape[:3], np.float32))
        expected.append(scores[:, :, leaving >= 0])

    threads: list[str] = []  # where each call that took rows in ran
    step = scorer.runtime.step

    def recorded(recurrent, new_key, *rest):
        if new_key.shape[2]:
            threads.append(threading.current_thread().name)
        return step(recurrent, new_key, *rest)

    monkeypatch.setattr(scorer.runtime, "step", recorded)
    state = scorer.init_state()
    for piece in pieces(scorer, lengths):
        scorer.take_piece(state, *piece)
    state.settle()

    assert len(threads) == len(lengths) and all(name.startswith("kvpop-scorer-") for name in threads)
    assert [positions.tolist() for positions, _ in state.staged] == [
        [position for position in leaving.tolist() if position >= 0] for _, _, leaving, _, _ in pieces(scorer, lengths)]
    for (_, scores), want in zip(state.staged, expected):
        np.testing.assert_array_equal(scores, want)
    for name, array in in_line.items():
        np.testing.assert_array_equal(state.recurrent[name], array)


def test_a_copy_waits_for_the_pieces_still_running(scorer):
    state = scorer.init_state()
    for piece in pieces(scorer, [6, 6]):
        scorer.take_piece(state, *piece)
    copied = state.copy()
    assert all(isinstance(scores, np.ndarray) for _, scores in copied.staged)
    for name, array in state.recurrent.items():
        np.testing.assert_array_equal(copied.recurrent[name], array)
