"""Line pooling: a learned score ranks whole lines of the prompt, not single tokens.

A learned scorer finds the rare line that matters (a pass key among pages of documentation) but scores
its tokens unevenly: it keeps the digits and drops the words that say what they are. Ranking each
prompt token by the MEAN score of its line (plus a small share of its own, so a line that does not fit
keeps its best tokens) keeps such a line whole, and, unlike the line's best score, does not favour long
lines that reach a high score somewhere by chance (docs/quality/real, session 19). Lines longer than
`MAX_SPAN` tokens are cut into pieces of that length. A line's mean is over every one of its tokens
scored so far, evicted or not, so evicting part of a line does not move the rest of it.

Only the prompt is pooled (the engine knows its tokens when the request arrives): generated tokens,
and positions whose score came from before this cache's spans were set (a session's earlier turns, a
warm prefix), keep the priority they had.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MAX_SPAN = 48  # tokens: a longer line (a paragraph) is ranked in pieces of this length
OWN_SHARE = 1e-3  # of a token's own score (relative to its line's mean) added to break ties inside a line


def check_span_pooling(span_pooling: str, shared_ranking: bool) -> None:
    """The one rule for a scorer's `span_pooling` setting (its training config and its exported spec):
    "" or "line", and "line" only with the shared ranking (a line's mean is over one model-wide score)."""
    if span_pooling not in ("", "line") or (span_pooling and not shared_ranking):
        raise ValueError(f"span_pooling must be '' or 'line' (with shared_ranking), got {span_pooling!r}")


def line_break_table(tokenizer, vocab_size: int) -> np.ndarray:
    """(V,) bool: whether each token's text holds a newline (a line ends after it). Ids the tokenizer
    does not know (an embedding table padded past its vocabulary) end no line."""
    known = min(vocab_size, len(tokenizer)) if hasattr(tokenizer, "__len__") else vocab_size
    table = np.zeros(vocab_size, dtype=bool)
    table[:known] = ["\n" in tokenizer.decode([token]) for token in range(known)]
    return table


@dataclass
class TextSpans:
    """One sequence's prompt cut into lines, and the running score sums that rank them."""

    span: np.ndarray  # (P,) int64: line index of each prompt position
    own: np.ndarray  # (P,) float32: each position's own score once scored, NaN before
    score_sum: np.ndarray  # (S,) float64: per line, the sum of its scored tokens' scores
    scored: np.ndarray  # (S,) int64: per line, how many of its tokens are scored

    @classmethod
    def of_prompt(cls, prompt_ids: "list[int] | np.ndarray", line_breaks: np.ndarray, max_span: int = MAX_SPAN) -> "TextSpans":
        ends = line_breaks[np.asarray(prompt_ids, np.int64)]  # (P,) the line ends after this token
        span = np.zeros(len(ends), np.int64)
        current, length = 0, 0
        for position, end in enumerate(ends):
            span[position] = current
            length += 1
            if end or length == max_span:
                current, length = current + 1, 0
        count = current + 1
        return cls(span, np.full(len(ends), np.nan, np.float32), np.zeros(count), np.zeros(count, np.int64))

    @property
    def prompt_length(self) -> int:
        return len(self.span)

    def add_scores(self, positions: np.ndarray, scores: np.ndarray) -> None:
        """Record the scores (M,) of positions (M,) that just left the window (each is scored once)."""
        inside = (positions >= 0) & (positions < self.prompt_length)
        positions, scores = positions[inside], scores[inside]
        fresh = np.isnan(self.own[positions])
        positions, scores = positions[fresh], scores[fresh]
        self.own[positions] = scores
        np.add.at(self.score_sum, self.span[positions], scores)
        np.add.at(self.scored, self.span[positions], 1)

    def priority(self, positions: np.ndarray, current: np.ndarray) -> np.ndarray:
        """The pooled priority of `positions` (any shape); `current` where a position has no pooled
        one (not in the prompt, or not scored by this cache's spans)."""
        inside = (positions >= 0) & (positions < self.prompt_length)
        index = np.where(inside, positions, 0)
        own = self.own[index]
        line = self.span[index]
        mean = (self.score_sum[line] / np.maximum(self.scored[line], 1)).astype(np.float32)
        pooled = mean + np.float32(OWN_SHARE) * (own - mean)
        return np.where(inside & ~np.isnan(own), pooled, current).astype(np.float32)
