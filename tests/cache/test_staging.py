"""Prompt chunks computed in pieces (kvpop.cache.staging): whatever pieces a chunk is cut into, and whether
a piece's call also returned attention (a piece batched beside another prompt's query window), the chunk
enters its cache as the one-call chunk would."""

from __future__ import annotations

import numpy as np
import pytest

from kvpop.cache import SlotCache
from kvpop.cache.staging import PromptStaging
from kvpop.decoder import StepOutput
from kvpop.model_spec import ModelSpec
from kvpop.policies import make_policy

SPEC = ModelSpec("LlamaForCausalLM", num_layers=2, num_attention_heads=4, num_kv_heads=2, head_dim=4, vocab_size=50,
                 dtype="float32", max_position_embeddings=512)
CHUNK = 20


def piece_output(key: np.ndarray, value: np.ndarray, with_attention: bool, past_slots: int) -> StepOutput:
    """A prompt call's output for one row: the piece's keys and values, and attention rows if asked."""
    tokens = key.shape[2]
    attention = np.full((SPEC.num_layers, 1, SPEC.num_attention_heads, tokens, past_slots), 0.5, np.float32) if with_attention else None
    chunk_attention = np.full((SPEC.num_layers, 1, SPEC.num_attention_heads, tokens, tokens), 0.5, np.float32) if with_attention else None
    logits = np.zeros((1, 1, SPEC.vocab_size), np.float32)
    return StepOutput(logits, key[:, None], value[:, None], attention, chunk_attention)


@pytest.mark.parametrize("cuts, with_attention", [
    ((7, 13, 20), (False, False, False)),  # lean pieces: written into the chunk's buffer
    ((5, 12, 20), (True, False, False)),  # the first piece came back with attention, the rest without
    ((9, 20), (False, True)),  # the last piece with attention (a query window's call)
])
def test_a_chunk_in_pieces_enters_its_cache_as_in_one_call(cuts, with_attention):
    rng = np.random.default_rng(0)
    shape = (SPEC.num_layers, SPEC.num_kv_heads, CHUNK, SPEC.head_dim)
    key, value = rng.standard_normal(shape).astype(np.float32), rng.standard_normal(shape).astype(np.float32)
    whole = SlotCache(SPEC, make_policy("streaming", sinks=2, window=4), budget=12)
    whole.append(key, value, None, None)
    pieces = SlotCache(SPEC, make_policy("streaming", sinks=2, window=4), budget=12)
    staging = PromptStaging(SPEC)
    start = 0
    for stop, attention in zip(cuts, with_attention):
        staging.inputs([pieces], ["r"])  # what the decoder would have been handed
        out = piece_output(key[:, :, start:stop], value[:, :, start:stop], attention, pieces.capacity + start)
        staging.store([pieces], ["r"], [CHUNK], out)
        assert staging.length("r") == (stop if stop < CHUNK else 0)
        start = stop
    assert pieces.tokens_seen == whole.tokens_seen == CHUNK
    np.testing.assert_array_equal(pieces.position, whole.position)
    np.testing.assert_array_equal(pieces.key, whole.key)
    np.testing.assert_array_equal(pieces.value, whole.value)
