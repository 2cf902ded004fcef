"""Prompt lookahead: the end of a prompt, known when the request arrives, scores the prompt as it is prefilled.

Why: a bounded cache evicts while its prompt is prefilled chunk by chunk, before the prompt's end is
read, and the end is usually where the question is. A serving engine has the whole prompt at
admission, so with every prompt chunk but the last it also runs the prompt's last `n` tokens (the
tail), at their true positions, as extra queries whose keys and values are thrown away: the cache
never holds them before their own chunk, so memory stays at the budget plus one chunk. What those
queries attend to, in the cache and in the chunk, is each token's lookahead score:

    log( mean over the n tail queries of its attention, max over the query heads of its KV group )

which is the quantity the learned scorer is trained to predict (future attention, log), measured from
the one future that is already known. The last chunk holds the tail itself; its own last rows score
it. The kvpop policy keeps a token by the larger of its learned score and its lookahead score
(kvpop.policies.kvpop). SnapKV (Li et al., 2024) scores a prompt by its last window the same way,
after a full-attention prefill of the whole prompt; here nothing is held beyond the budget.

Cost: n more query rows per chunk (the attention step variant), and none once the prompt is in.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

FLOOR = np.float32(-np.inf)  # lookahead score of a token no tail query has seen (a generated token)
EPSILON = 1e-9  # attention floor before the log


@dataclass(frozen=True)
class ChunkQueries:
    """Where one prompt chunk's lookahead queries are in its decoder call."""

    appended: int  # tail tokens run after the chunk's own tokens (0 for the last chunk, or no lookahead)
    rows: slice | None  # the rows of the call that are the tail's queries; None: no lookahead


def chunk_queries(prompt_tokens: int, lookahead: int, start: int, length: int) -> ChunkQueries:
    """The tail queries of the chunk [start, start + length) of a `prompt_tokens`-token prompt."""
    tail = min(lookahead, prompt_tokens)
    if tail <= 0:
        return ChunkQueries(0, None)
    if start + length < prompt_tokens:  # not the last chunk: the tail runs after it, thrown away
        return ChunkQueries(tail, slice(length, length + tail))
    return ChunkQueries(0, slice(max(0, length - tail), length))  # the last chunk's own last rows


def tail_inputs(prompt_ids: list[int], appended: int) -> tuple[list[int], np.ndarray]:
    """The tail's token ids and their true positions in the prompt."""
    start = len(prompt_ids) - appended
    return prompt_ids[start:], np.arange(start, len(prompt_ids), dtype=np.int64)


def lookahead_scores(
    attention: np.ndarray,  # (L, Hq, T', S): one row's attention on the cached slots (S >= capacity)
    chunk_attention: np.ndarray,  # (L, Hq, T', T'): on the call's own tokens
    rows: slice,  # the tail queries among the T' rows
    capacity: int,  # C: the cache's slots (the rest of S is padding)
    length: int,  # T: the chunk's own tokens (the first T of the T' rows)
    group: int,  # query heads per KV head
) -> np.ndarray:
    """(L, Hkv, C + T) float32: the lookahead score of every cached slot and every new token."""
    on_cache = attention[:, :, rows, :capacity]  # (L, Hq, n, C)
    on_chunk = chunk_attention[:, :, rows, :length]  # (L, Hq, n, T)
    received = np.concatenate([on_cache, on_chunk], axis=3).mean(axis=2)  # (L, Hq, C + T)
    num_layers, num_query_heads, candidates = received.shape
    per_group = received.reshape(num_layers, num_query_heads // group, group, candidates).max(axis=2)  # (L, Hkv, C + T)
    return np.log(per_group + EPSILON).astype(np.float32)
