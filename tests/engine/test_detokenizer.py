"""The answer's text token by token: whole characters only, cut before a stop string, never released early."""

from __future__ import annotations

import pytest

from kvpop.engine.detokenizer import IncrementalDetokenizer

TEXT = "KVpop keeps a fixed budget: ünïcödé ✓ 漢字 and emoji 🙂 survive streaming."


@pytest.fixture(scope="module")
def tokenizer(tiny_hf_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_hf_model_dir)


def stream(tokenizer, ids: list[int], stop: tuple[str, ...] = ()) -> tuple[list[str], IncrementalDetokenizer]:
    """What a stream hands out token by token (the last piece with the end), as the engine does."""
    detokenizer, pieces = IncrementalDetokenizer(tokenizer, stop), []
    for token in ids:
        if detokenizer.push(token) is not None:
            break
        pieces.append(detokenizer.take())
    detokenizer.flush()
    return pieces + [detokenizer.take(final=True)], detokenizer


def test_streamed_text_joins_to_the_decoded_text(tokenizer):
    ids = tokenizer(TEXT, add_special_tokens=False).input_ids
    pieces, detokenizer = stream(tokenizer, ids)
    assert "".join(pieces) == detokenizer.text == tokenizer.decode(ids) == TEXT
    assert all("\ufffd" not in piece for piece in pieces)  # never a half character


def token_spans(tokenizer, ids: list[int]) -> list[tuple[int, int]]:
    """Each token's [start, end) in the decoded text."""
    spans, end = [], 0
    for count in range(1, len(ids) + 1):
        length = len(tokenizer.decode(ids[:count]))
        spans.append((end, length))
        end = length
    return spans


def test_a_stop_string_ending_inside_a_token_cuts_before_it_and_drops_the_rest_of_that_token(tokenizer):
    ids = tokenizer(TEXT, add_special_tokens=False).input_ids
    start, end = next(span for span in token_spans(tokenizer, ids)[3:] if span[1] - span[0] >= 3)
    stop = TEXT[start - 4 : start + 1]  # ends one character into a token of three or more
    pieces, detokenizer = stream(tokenizer, ids, (stop, "never there"))
    assert detokenizer.matched_stop == stop
    assert "".join(pieces) == detokenizer.text == TEXT[: TEXT.index(stop)]


def test_text_that_may_begin_a_stop_string_is_held_back_until_it_cannot(tokenizer):
    ids = tokenizer(TEXT, add_special_tokens=False).input_ids
    stop = "fixed budget!"  # the text has "fixed budget:": every prefix up to the colon is held, then released
    pieces, detokenizer = stream(tokenizer, ids, (stop,))
    assert detokenizer.matched_stop is None and "".join(pieces) == TEXT
    released = ""
    for piece in pieces[:-1]:
        released += piece
        assert not any(released.endswith(stop[:length]) for length in range(1, len(stop)))
