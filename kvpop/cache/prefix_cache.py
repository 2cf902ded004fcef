"""Warm prefixes: the cache states of common prompt beginnings (system prompts, chat-template
headers), prefilled once when the model loads and copied into every request that starts with one.

Why snapshots of whole cache states and not shared blocks (vLLM's prefix caching): a bounded cache
has no token-addressed blocks to share; its slots are overwritten in place by the running sequence.
So a prefix is kept as the complete state a cold prefill leaves after it (slots, positions,
statistics, policy and scorer state: a `SessionState`), and a request starts from a COPY of it
(`kvpop.cache.snapshot.restore_cache` copies every array), never from the snapshot itself.

A snapshot is specific to the cache configuration it was made with: policy, budget, sinks, window,
seed and scorer (`CacheConfig` as a dict) must all be equal for a hit. What reuse gives:
  - `full` keeps every token, so the snapshot holds the whole prefix and reuse is a cold prefill
    whose chunks restart at the prefix's end: the same cached keys and values up to float summation
    order, and in the tests the same greedy tokens.
  - a bounded policy's snapshot is the state after the first `floor(n / chunk) * chunk` prefix
    tokens, fed alone in chunks of the request's chunk size (min(prefill_chunk, budget)). That is
    exactly where a cold prefill of any prompt starting with the prefix stands after those chunks
    (same chunk boundaries: the same evictions at the same moments, the same statistics), so reuse
    gives the same cache state and the same tokens as a cold prefill. A snapshot cut elsewhere would
    continue with other chunk boundaries, which can evict differently once the prompt exceeds the
    budget (what a session's next turn does on purpose).

Entries are few (prefixes x configurations) and read-only after warm-up, so a lookup scans them all
and the longest matching prefix wins; there is no eviction.
"""

from __future__ import annotations

from typing import Any, Iterator

from kvpop.sessions import SessionState


class PrefixCache:
    """Snapshots of warm prefixes, per cache configuration; filled at load, then only read."""

    def __init__(self) -> None:
        self._snapshots: list[SessionState] = []

    def __len__(self) -> int:
        return len(self._snapshots)

    def __iter__(self) -> Iterator[SessionState]:
        return iter(list(self._snapshots))

    @property
    def nbytes(self) -> int:
        return sum(snapshot.nbytes for snapshot in self._snapshots)

    def add(self, snapshot: SessionState) -> None:
        """Keep `snapshot` (replacing one of the same tokens and configuration)."""
        self._snapshots = [kept for kept in self._snapshots if not self._same(kept, snapshot)] + [snapshot]

    @staticmethod
    def _same(a: SessionState, b: SessionState) -> bool:
        return a.cache_options == b.cache_options and a.budget == b.budget and a.tokens.tolist() == b.tokens.tolist()

    def match(self, cache_options: dict[str, Any], budget: int | None, prompt_ids: list[int]) -> SessionState | None:
        """The longest snapshot of this configuration whose tokens begin `prompt_ids` and leave at
        least one prompt token to compute (the first output needs its logits); None if none does."""
        matches = [
            snapshot for snapshot in self._snapshots
            if snapshot.cache_options == cache_options and snapshot.budget == budget and snapshot.reusable_for(prompt_ids)
        ]
        return max(matches, key=lambda snapshot: snapshot.tokens_seen, default=None)


__all__ = ["PrefixCache"]
