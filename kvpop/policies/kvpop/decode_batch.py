"""One decode step's appends for many full kvpop caches at once: the steady state of a bounded batch.

Why: appending one token per sequence through `SlotCache.append` costs some sixty small numpy calls
and one scorer call per sequence per step (on the reference model that is more than the decoder
step itself: docs/PERFORMANCE.md). In the steady state every such append is the same few
operations: score the one token leaving the protected window, drop each head's lowest-priority
unprotected slot, write the new token there. Here they run vectorised over the batch, with tensors
(B, L, Hkv, C), and the learned scorer runs once for the batch (`LearnedScorer.score_decode_batch`).

The cache manager groups a decode step's caches by `EvictionPolicy.decode_group` and hands each group
to its policy's `append_decode_group` (this module's `_append_group`); the decisions are exactly the
per-sequence path's (tests/cache/test_decode_batch.py compares caches and tokens). Everything else keeps the per-sequence path: prompt chunks, caches still filling up, other
policies, scorers that read attention, a sequence whose scorer still holds tokens from its prefill.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any, Hashable

import numpy as np

from kvpop.policies.kvpop.kinds import SCORE

if TYPE_CHECKING:
    from kvpop.kvtypes import BatchRows
    from kvpop.kvtypes import CacheView as SlotCache


def batch_group(policy: Any, cache: "SlotCache") -> Hashable | None:
    """Caches with equal groups can take this decode step together; None: this one takes the
    per-sequence path (see the module docstring for when)."""
    if cache.budget is None or cache.length != cache.capacity:
        return None
    if cache.capacity != cache.budget or not policy.decodes_in_batch(cache):
        return None
    sinks, window = policy.protected_counts(cache.budget)
    return (id(policy.token_scorer), sinks, window, cache.capacity)


@dataclass
class _StackedGroup:
    """The per-slot arrays of a group's caches side by side, (B, L, Hkv, C): each cache's `position`
    and kvpop score are row views of them, so while the same caches decode on together a step stacks
    nothing (a cache whose arrays were replaced since, or another order, stacks them anew)."""

    caches: list["SlotCache"]
    views: list[tuple[np.ndarray, np.ndarray]]  # per cache: (position, score), the views it was given
    position: np.ndarray  # (B, L, Hkv, C) int64
    score: np.ndarray  # (B, L, Hkv, C) float32

    @classmethod
    def stack(cls, caches: list["SlotCache"]) -> "_StackedGroup":
        position = np.stack([cache.position for cache in caches])
        score = np.stack([cache.statistics[SCORE] for cache in caches])
        views = []
        for row, cache in enumerate(caches):
            cache.position, cache.statistics[SCORE] = position[row], score[row]
            views.append((cache.position, cache.statistics[SCORE]))
        return cls(caches, views, position, score)

    def holds(self, caches: list["SlotCache"]) -> bool:
        return len(caches) == len(self.caches) and all(
            cache is held and cache.position is position and cache.statistics[SCORE] is score
            for cache, held, (position, score) in zip(caches, self.caches, self.views)
        )


@lru_cache(maxsize=64)
def _index_grids(batch: int, layers: int, kv_heads: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Index arrays broadcasting to (B, L, Hkv): batch row, layer, KV head."""
    grids = np.arange(batch)[:, None, None], np.arange(layers)[None, :, None], np.arange(kv_heads)[None, None, :]
    for grid in grids:
        grid.flags.writeable = False
    return grids


def _append_group(
    caches: list["SlotCache"], rows: np.ndarray, pool: "BatchRows", new_key: np.ndarray, new_value: np.ndarray,
    last: _StackedGroup | None,
) -> _StackedGroup:
    """B full caches of one kvpop policy configuration, each with exactly one token leaving its window."""
    policy = caches[0].policy  # the group's KVpopPolicy
    sinks, window = policy.protected_counts(caches[0].budget)
    num_layers, batch_size, num_kv_heads, _, _ = new_key.shape
    batch, layer, head = _index_grids(len(caches), num_layers, num_kv_heads)
    pool_row = rows[:, None, None]
    group = last if last is not None and last.holds(caches) else _StackedGroup.stack(caches)
    position, score = group.position, group.score  # (B, L, Hkv, C); row r is caches[r]'s own array

    seen = np.array([cache.tokens_seen for cache in caches], np.int64)[:, None, None, None]  # (B, 1, 1, 1)
    if len(rows) == batch_size:  # every row of the step (rows are ascending): views, no gather
        token_key, token_value = (array[:, :, :, 0].transpose(1, 0, 2, 3) for array in (new_key, new_value))
    else:  # (L, B, Hkv, 1, D) -> (B, L, Hkv, D)
        token_key, token_value = (array[:, rows][:, :, :, 0].transpose(1, 0, 2, 3) for array in (new_key, new_value))

    # The token leaving the window (every head holds it: it was protected) gets its fixed score.
    leaving = (position == seen - window).argmax(axis=3)  # (B, L, Hkv) slot
    if caches[0].budget == sinks + window:  # no long-range slot: the leaving token is the one unprotected slot
        dropped = leaving  # (B, L, Hkv) slot; no score can change that, so none is computed
    else:
        leaving_key = pool.key[layer, pool_row, head, leaving]  # (B, L, Hkv, D)
        leaving_value = pool.value[layer, pool_row, head, leaving]
        states = [cache.policy_state for cache in caches]
        score[batch, layer, head, leaving] = policy.token_scorer.score_decode_batch(
            states, token_key, token_value, leaving_key, leaving_value
        )
        for row, cache in enumerate(caches):  # a prompt token's score moves its whole line (as observe does)
            policy.pool_leaving_prompt_token(cache, position[row], score[row], leaving[row])
        # Each head drops its lowest-priority unprotected slot (the new token is in the window: kept).
        protected = (position < sinks) | (position >= seen + 1 - window)
        dropped = np.where(protected, np.inf, score).argmin(axis=3)  # (B, L, Hkv) slot
    pool.key[layer, pool_row, head, dropped] = token_key
    pool.value[layer, pool_row, head, dropped] = token_value
    position[batch, layer, head, dropped] = seen[..., 0]
    score[batch, layer, head, dropped] = 0.0  # a new token's score until it leaves the window
    if pool.track_writes:  # a device mirror: each cache records the slot every head wrote
        every_head = np.broadcast_to(layer[0], (num_layers, num_kv_heads)), np.broadcast_to(head[0], (num_layers, num_kv_heads))
        for row, cache in enumerate(caches):
            cache.record_write((*every_head, dropped[row]))
    for cache in caches:
        cache.tokens_seen += 1
    return group
