"""The prefill pacer (kvpop.engine.prefill_pacer) sizes a step's prompt work from measured step times."""

from __future__ import annotations

import pytest

from kvpop.engine.prefill_pacer import PrefillPacer


def test_it_starts_small_and_converges_on_the_target_share_of_a_decode_step():
    pacer = PrefillPacer(ratio=1.5, min_tokens=8)
    pacer.observe_decode(0.010)  # 10 ms decode steps: the target is 15 ms of prompt work
    tokens = pacer.step_tokens(256)
    assert tokens == 8  # nothing measured yet: the first prompt beside running streams stalls nobody
    for _ in range(12):  # a model where a prompt token costs 0.25 ms (60 tokens = 15 ms)
        pacer.observe_prefill(0.00025 * tokens, tokens)
        tokens = pacer.step_tokens(256)
    assert 55 <= tokens <= 60


def test_it_stays_between_the_floor_and_the_ceiling():
    pacer = PrefillPacer(ratio=1.0, min_tokens=4)
    pacer.observe_decode(0.001)
    for _ in range(4):  # prompt work far slower than a decode step: it halves at most per step
        pacer.observe_prefill(1.0, pacer.step_tokens(256))
    assert pacer.step_tokens(256) == 4
    for _ in range(6):  # and far faster: it doubles at most per step, up to the ceiling
        pacer.observe_prefill(0.000001, pacer.step_tokens(64))
    assert pacer.step_tokens(64) == 64


def test_one_short_step_does_not_throw_it_off():
    pacer = PrefillPacer(ratio=1.0, min_tokens=8)
    pacer.observe_decode(0.010)
    pacer.step_tokens(256)
    pacer.observe_prefill(0.00001, 8)  # the last few tokens of a prompt, nearly free
    assert pacer.step_tokens(256) == 16


def test_bad_settings_are_refused():
    with pytest.raises(ValueError):
        PrefillPacer(ratio=0)
