"""KVpop ("KVpop - Retrofitting LLMs with xLSTM-guided Token Eviction", NXAI / JKU Linz).

Budget B = s sinks + w protected recent tokens + k long-range slots. A token is scored only when it
LEAVES the window (so the scorer has seen w tokens of its future); its score is then fixed. The
leaving token competes with the kept long-range tokens and the lowest is evicted. Ranking all
non-protected candidates by their fixed scores and keeping the top is exactly that rule, applied to
every token that left during the append. The scorer is pluggable (see scorers.py). A learned scorer
whose config says `span_pooling: line` has prompt tokens ranked by their line's mean score instead
(text_spans.py): the whole line moves when one of its tokens is scored.

At a tight budget the window shrinks to a quarter of it, never below `min_window` tokens (the question
and the chat header at the end of a prompt): at 94% of a 2,048-token prompt the budget is 125 slots, and a
64-token window would leave 57 long-range slots, under three needle lines of a multi-key task
(docs/QUALITY.md). Every step of the policy pairs leaving tokens with that window.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np

from kvpop.kvtypes import CacheUpdate, StatisticsUpdate
from kvpop.policies.base import EvictionPolicy
from kvpop.policies.kvpop.scorers import LeavingTokens, TokenScorer, make_scorer
from kvpop.policies.kvpop import decode_batch, state_codec
from kvpop.policies.kvpop.kinds import LEARNED_SCORER_KINDS, SCORE, learned_scorer, load_learned_scorers
from kvpop.policies.kvpop.settings import KVpopSettings
from kvpop.policies.kvpop import query
from kvpop.policies.kvpop.text_spans import TextSpans, check_span_pooling, span_ends



def _pooled(spans: TextSpans, positions: np.ndarray, current: np.ndarray) -> np.ndarray:
    """`spans.priority`, with the question's picks (query.py) keeping their bonus on top of their span's rank."""
    bonus = query.query_bonus(current)
    return spans.priority(positions, current - bonus) + bonus


QUERY_HEADS = ("auto", "head", "retrieval")
FILLS = ("scorer", "recency")
RECENCY_SCALE = np.float32(2**20)  # positions / this: a recency score stays far under query.QUERY_BONUS


@dataclass
class KVpopPolicy(EvictionPolicy):
    name = "kvpop"
    uses_sinks = True
    uses_window = True
    sinks: int = 4
    window: int = 64
    scorer: "str | TokenScorer" = "accumulated_attention"
    window_share: float = 0.25  # the window takes at most this share of the budget ...
    min_window: int = 32  # ... but never fewer tokens than this (nor more than `window`)
    # How prompt tokens are ranked by span (text_spans.py); None: query.SPAN_POOLING when the question picks (below),
    # else as the scorer was trained.
    span_pooling: "str | None" = None
    # > 0: a prompt entering whole lets its last this many queries pick (query.py) ...; None: query.WINDOW when the
    # learned scorer's model ships retrieval heads (what docs/QUALITY.md measured), else 0 (off)
    query_window: "int | None" = None
    query_share: float = 0.5  # ... this share of the long-range slots,
    # "head": each KV head picks its own (SnapKV); "retrieval": one pick for every cache, from the retrieval heads'
    # attention (the learned scorer's model ships them: query.py); "auto": retrieval when they ship, else head
    query_heads: str = "auto"
    # What ranks the long-range slots the question does not pick: "scorer" (the method), or "recency" (the newest
    # tokens, scorer and span pooling unused: the ablation that measures what the learned ranking adds)
    fill: str = "scorer"
    _scorer: TokenScorer = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.sinks < 0 or self.window < 0:
            raise ValueError(f"kvpop: sinks and window must be >= 0, got sinks={self.sinks} window={self.window}")
        if not 0.0 < self.window_share <= 1.0 or self.min_window < 0:
            raise ValueError(f"kvpop: window_share must be in (0, 1] and min_window >= 0, got {self.window_share}, {self.min_window}")
        if (self.query_window is not None and self.query_window < 0) or not 0.0 <= self.query_share <= 1.0 \
                or self.query_heads not in QUERY_HEADS:
            raise ValueError(f"kvpop: query_window must be >= 0, query_share in [0, 1] and query_heads one of {QUERY_HEADS}, "
                             f"got {self.query_window}, {self.query_share}, {self.query_heads!r}")
        if self.fill not in FILLS:
            raise ValueError(f"kvpop: fill must be one of {FILLS}, got {self.fill!r}")
        self._scorer = make_scorer(self.scorer)
        if self.query_window is None:
            self.query_window = query.WINDOW if self._scorer.retrieval_heads is not None else 0
        if self.query_heads == "auto":
            self.query_heads = "head" if self._scorer.retrieval_heads is None else "retrieval"
        elif self.query_heads == "retrieval" and self._scorer.retrieval_heads is None:
            raise ValueError("kvpop: query_heads 'retrieval' needs a learned scorer whose model ships retrieval_heads.json")
        if self.span_pooling is None:
            picks = self.query_window > 0 and self._scorer.shared_ranking
            self.span_pooling = query.SPAN_POOLING if picks else self._scorer.span_pooling
        elif self.span_pooling and not self._scorer.shared_ranking:
            raise ValueError(f"kvpop: span_pooling {self.span_pooling!r} needs a learned scorer with one model-wide ranking")
        check_span_pooling(self.span_pooling, shared_ranking=True)

    Settings = KVpopSettings

    @classmethod
    def from_options(cls, options, assets: "dict[str, TokenScorer] | None" = None) -> "KVpopPolicy":
        """A learned `scorer` kind resolves to the model's loaded network (`assets`: its learned scorers by
        kind), whose protected window (the one it was trained for) replaces `window`."""
        if isinstance(options.scorer, str) and options.scorer in LEARNED_SCORER_KINDS:
            network = learned_scorer(options.scorer, assets or {})
            options = replace(options, scorer=network, window=getattr(network, "window", options.window))
        return super().from_options(options, assets)

    @classmethod
    def check_options(cls, options) -> None:
        """A learned scorer is checked against the model that runs it (its assets); the rest here."""
        if options.scorer not in LEARNED_SCORER_KINDS:
            super().check_options(options)

    @classmethod
    def load_assets(cls, model_dir) -> "dict[str, TokenScorer]":
        """The learned scorers exported beside the decoder, by kind."""
        return load_learned_scorers(model_dir)

    @property
    def needs_attention(self) -> bool:
        return self._scorer.needs_attention

    @property
    def token_scorer(self) -> TokenScorer:
        return self._scorer

    def protected_counts(self, budget: int) -> tuple[int, int]:
        """(sinks, window) under `budget`: the window is at most `window_share` of the budget, at least
        `min_window` tokens, at most `window` (and, as for every policy, what fits beside the sinks)."""
        sinks, window = super().protected_counts(budget)
        return sinks, min(window, max(self.min_window, math.ceil(self.window_share * budget)))

    def long_range_slots(self, budget: int) -> int:
        """Slots per head kept by score: the budget beyond the sinks and the window. With none, every
        token leaving the window is dropped whatever its score (this is StreamingLLM), so the scorer
        is never consulted: a short request at a high compression pays nothing for it."""
        sinks, window = self.protected_counts(budget)
        return budget - sinks - window

    def consults_scorer(self, cache, new_tokens: int) -> bool:
        """Whether an append of `new_tokens` needs the scorer: only when a score can decide an
        eviction, now (this append evicts) or later (the scorer keeps pace, or cannot catch up)."""
        if self.long_range_slots(cache.budget) <= 0:
            return False
        return not (self._scorer_behind(cache) and cache.length + new_tokens <= cache.budget)

    def _scorer_behind(self, cache) -> bool:
        """Whether the scorer has not scored this cache's tokens yet. A scorer that reads only keys
        and values (`TokenScorer.catches_up`) waits until the cache first has to evict: until then every
        token is still in the cache and no score is needed (a request that never fills its budget never
        runs it), and that first evicting append takes the whole history in at once, paired exactly as
        one by one, its leaving tokens from the sinks on (`_first_leaving`). Asked only of a cache with
        long-range slots (without, the scorer is never consulted)."""
        return self._scorer.catches_up and cache.tokens_evicted == 0

    def _first_leaving(self, cache) -> int:
        """The first position that leaves the window in the next append and still needs its score."""
        sinks, window = self.protected_counts(cache.budget)
        return sinks if self._scorer_behind(cache) else max(cache.tokens_seen - window, sinks)

    @staticmethod
    def _history(cache) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(positions (n,), key (L, Hkv, n, D), value) of every token seen, in position order: a cache
        that never evicted holds them all, each head in the same slots."""
        seen = cache.tokens_seen
        order = np.argsort(cache.position[0, 0, :seen], kind="stable")
        return cache.position[0, 0, order], cache.key[:, :, order], cache.value[:, :, order]

    def decodes_in_batch(self, cache) -> bool:
        """Whether this full cache's next one-token append may run vectorised with others
        (kvpop.policies.kvpop.decode_batch): exactly one token leaves the window, the new token stays in it, an
        unprotected slot exists to drop, and the scorer is not needed or can score a batch in this
        state."""
        sinks, window = self.protected_counts(cache.budget)
        if not (window >= 1 and cache.budget >= sinks + window and cache.tokens_seen - window >= sinks):
            return False
        if cache.budget == sinks + window:  # no long-range slot: the leaving token is the one dropped
            return True
        return self.fill == "scorer" and not self._scorer_behind(cache) and self._scorer.scores_decode_batch(cache.policy_state)

    def decode_group(self, cache):
        return decode_batch.batch_group(self, cache)

    def append_decode_group(self, caches, rows, pool, new_key, new_value, last):
        return decode_batch._append_group(caches, rows, pool, new_key, new_value, last)

    def encode_state(self, state):
        return state_codec.encode(state) if state_codec.is_scorer_state(state) else super().encode_state(state)

    def decode_state(self, description, arrays):
        return state_codec.decode(description, arrays) if description.get("kind") == state_codec.SCORER else super().decode_state(description, arrays)

    def prompt_state(self, prompt_ids: list[int], tokenizer, vocab_size: int) -> "TextSpans | None":
        """The prompt cut into spans, when prompt tokens are ranked by span (needs the tokenizer), else None."""
        if not self.span_pooling or tokenizer is None:
            return None
        return TextSpans.of_prompt(prompt_ids, span_ends(tokenizer, vocab_size, self.span_pooling), self.span_pooling)

    @classmethod
    def prepare(cls, assets: "dict[str, TokenScorer] | None", tokenizer, vocab_size: int) -> None:
        """The span-end tables now (0.13 s each for SmolLM2's 49,152 tokens), not on a request's first step."""
        if tokenizer is not None and assets:
            for pooling in ("line", "sentence"):
                span_ends(tokenizer, vocab_size, pooling)

    def pool_leaving_prompt_token(self, cache, position: np.ndarray, score: np.ndarray, leaving: np.ndarray) -> None:
        """Line pooling for a vectorised decode step (kvpop.policies.kvpop.decode_batch), as `observe` pools a
        one-sequence step: `score` (L, Hkv, C), the cache's row of the batch's scores, holds the leaving
        token's raw score at slots `leaving` (L, Hkv); if that token is in the prompt, its line's mean
        takes it in and every held token of the prompt gets its pooled priority, in place."""
        spans = self._line_spans(cache)
        if spans is None or cache.tokens_seen - self.protected_counts(cache.budget)[1] >= spans.prompt_length:
            return
        first = leaving[0, 0]
        spans.add_scores(position[0, 0, first : first + 1], score[0, 0, first : first + 1])
        score[...] = _pooled(spans, position, score)

    def _line_spans(self, cache) -> "TextSpans | None":
        """The cache's prompt lines when this scorer ranks by line (kvpop.policies.kvpop.text_spans), else None."""
        return cache.prompt_state if self.span_pooling else None

    @property
    def statistics(self) -> tuple[str, ...]:
        return (SCORE, *self._scorer.statistics)

    def init_state(self):
        return self._scorer.init_state()  # the scorer's per-sequence state is the policy's

    def observe(self, cache, update) -> StatisticsUpdate:
        if not self.consults_scorer(cache, update.num_tokens):  # every score stays 0: none decides anything
            return StatisticsUpdate({name: np.zeros(update.key.shape[:3], np.float32) for name in self.statistics})
        state = cache.policy_state
        seen_update = update  # what the scorer takes in: with its history first when it catches up now
        if self._scorer_behind(cache) and not self._scorer.scored_in_pieces(state):
            positions, key, value = self._history(cache)
            seen_update = CacheUpdate(np.concatenate([positions, update.positions]), np.concatenate([key, update.key], axis=2),
                                      np.concatenate([value, update.value], axis=2), None, None)
        scorer_update = self._scorer.observe(cache, state, seen_update)
        new_statistics = {**scorer_update.new, SCORE: np.zeros_like(update.key[..., 0], dtype=np.float32)}  # (L, Hkv, T)
        window = self.protected_counts(cache.budget)[1]
        first, stop = self._first_leaving(cache), cache.tokens_seen + update.num_tokens - window  # leaving: [first, stop)
        if stop <= first:
            return StatisticsUpdate(new_statistics, scorer_update.cached)
        # The scorer's statistics as they are after this append (its update applied).
        statistics = {name: scorer_update.cached.get(name, cache.statistics[name]) for name in self._scorer.statistics}
        # Old slots holding leaving tokens (every head holds all of them: they were protected).
        held = (cache.position >= first) & (cache.position < stop)  # (L, Hkv, C)
        old_count = int(held[0, 0].sum())
        if old_count == 1:  # a decode step: one token leaves
            slots = held.argmax(axis=2)[..., None]  # (L, Hkv, 1)
        else:
            slots = np.argsort(~held, axis=2, kind="stable")[..., :old_count]  # (L, Hkv, M_old)
        # New tokens that leave on arrival (a chunk longer than the window).
        new_tokens = np.flatnonzero((update.positions >= first) & (update.positions < stop))  # (M_new,)

        def gather(old: np.ndarray, new: np.ndarray) -> np.ndarray:  # (L, Hkv, C|T, ...) -> (L, Hkv, M, ...)
            index = slots if old.ndim == 3 else slots[..., None]
            return np.concatenate([np.take_along_axis(old, index, axis=2), new[:, :, new_tokens]], axis=2)

        scored = self._scorer.scored_in_pieces(state)  # then only positions are looked up
        leaving = LeavingTokens(
            positions=gather(cache.position, np.broadcast_to(update.positions, new_statistics[SCORE].shape)),
            key=None if scored else gather(cache.key, update.key),
            value=None if scored else gather(cache.value, update.value),
            statistics={name: gather(statistics[name], new_statistics[name]) for name in self._scorer.statistics},
        )
        scores = np.asarray(self._scorer.score(cache, state, leaving), dtype=np.float32)
        if self.fill == "recency":
            scores = leaving.positions.astype(np.float32) / RECENCY_SCALE
        cached_score = cache.statistics[SCORE].copy()  # (L, Hkv, C): the leaving old slots get their score
        spans = self._line_spans(cache)
        if spans is not None and self.fill == "scorer":  # every cache ranks the same positions (shared ranking): one line mean each
            spans.add_scores(leaving.positions[0, 0], scores[0, 0])
            scores = _pooled(spans, leaving.positions, scores)
            cached_score = _pooled(spans, cache.position, cached_score)  # held tokens of those lines move too
        if update.query_attention is not None:  # a whole prompt's question picks its share (query.py)
            sinks, window = self.protected_counts(cache.budget)
            picks = round(self.query_share * self.long_range_slots(cache.budget))
            cached_score, scores = query.pick(cached_score, cache.position, scores, leaving.positions, update.positions,
                                              update.query_attention, sinks, stop, picks, spans,
                                              self._scorer.retrieval_heads if self.query_heads == "retrieval" else None)
        np.put_along_axis(cached_score, slots, scores[..., :old_count], axis=2)
        new_statistics[SCORE][:, :, new_tokens] = scores[..., old_count:]
        return StatisticsUpdate(new_statistics, {**scorer_update.cached, SCORE: cached_score})

    def stage(self, cache, staged, rows: slice, chunk_length: int) -> None:
        """Let a learned scorer take a staged chunk's rows in now (`LearnedScorer.take_piece`), each
        paired with the token that leaves the window when it arrives, as `observe` pairs the whole
        chunk's: the chunk's completing step then only looks the scores up (a 246-token SmolLM2 chunk's
        scorer work, ~45 ms, would otherwise land on one engine step). A scorer that catches up takes
        the cache's history in with the first piece of the chunk that first evicts."""
        if not self._scorer.takes_pieces or not self.consults_scorer(cache, chunk_length):
            return
        seen = cache.tokens_seen  # unchanged while the chunk is staged
        window = self.protected_counts(cache.budget)[1]
        first = self._first_leaving(cache)
        position = seen + np.arange(rows.start, rows.stop)  # (t,) the rows' positions
        new_key, new_value = staged.key[:, :, rows], staged.value[:, :, rows]
        if self._scorer_behind(cache) and not self._scorer.scored_in_pieces(cache.policy_state):
            history, history_key, history_value = self._history(cache)
            position = np.concatenate([history, position])
            new_key, new_value = np.concatenate([history_key, new_key], axis=2), np.concatenate([history_value, new_value], axis=2)
        partner = np.where(position - window >= first, position - window, -1)  # (t,) position leaving at each row
        num_layers, num_kv_heads, _, head_dim = staged.key.shape
        leaving_key = np.zeros((num_layers, num_kv_heads, len(position), head_dim), np.float32)
        leaving_value = np.zeros_like(leaving_key)
        old = (partner >= 0) & (partner < seen)  # in the cache: every head holds it (it was protected)
        if old.any():
            slots = (cache.position[:, :, :, None] == partner[old]).argmax(axis=2)[..., None]  # (L, Hkv, m, 1)
            leaving_key[:, :, old] = np.take_along_axis(cache.key, slots, axis=2)
            leaving_value[:, :, old] = np.take_along_axis(cache.value, slots, axis=2)
        new = partner >= seen  # an earlier row of this chunk (a chunk longer than the window)
        leaving_key[:, :, new] = staged.key[:, :, partner[new] - seen]
        leaving_value[:, :, new] = staged.value[:, :, partner[new] - seen]
        self._scorer.take_piece(cache.policy_state, new_key, new_value, partner, leaving_key, leaving_value)

    def score(self, cache, candidates) -> np.ndarray:
        return candidates.statistics[SCORE]
