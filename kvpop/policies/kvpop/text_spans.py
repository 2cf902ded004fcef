"""Line pooling: a learned score ranks whole lines of the prompt, not single tokens.

A learned scorer finds the rare line that matters (a pass key among pages of documentation) but scores
its tokens unevenly: it keeps the digits and drops the words that say what they are. Ranking each
prompt token by the MEAN score of its line (plus a small share of its own, so a line that does not fit
keeps its best tokens) keeps such a line whole, and, unlike the line's best score, does not favour long
lines that reach a high score somewhere by chance (docs/QUALITY.md). Lines longer than
`MAX_SPAN` tokens are cut into pieces of that length. A line's mean is over every one of its tokens
scored so far, evicted or not, so evicting part of a line does not move the rest of it.

"line_contrast" ranks a line by how far its mean stands out from the text around it: the
mean minus the mean score of the `CONTRAST_WIDTH` scored tokens around the line (half before, half
after, the line left out), plus the mean of the whole prompt so the values stay on the scale of a raw
score (generated tokens compete with them). The scores fall by ~1.5 from the prompt's first lines (a
system prompt, an instruction) to its middle; by the plain mean those first lines outrank a needle in
the middle and take the budget at high compression.

"sentence" and "sentence_contrast" also end a span after every token that ends a sentence (".", "!",
"?"), so a fact written inside a paragraph (a pasted document, an e-mail) is ranked as its own span
instead of as a small part of a long one; on text with one fact a line they rank as the line poolings.

Only the prompt is pooled (the engine knows its tokens when the request arrives): generated tokens,
and positions whose score came from before this cache's spans were set (a session's earlier turns, a
warm prefix), keep the priority they had.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


SPAN_POOLINGS = ("", "line", "line_contrast", "sentence", "sentence_contrast")
MAX_SPAN = 48  # tokens: a longer line (a paragraph) is ranked in pieces of this length
OWN_SHARE = 1e-3  # of a token's own score (relative to its line's mean) added to break ties inside a line
CONTRAST_WIDTH = 384  # positions around a line whose scores it is measured against ("line_contrast")


def check_span_pooling(span_pooling: str, shared_ranking: bool) -> None:
    """The one rule for a scorer's `span_pooling` setting (its training config and its exported spec):
    one of SPAN_POOLINGS, and a line ranking only with the shared ranking (one model-wide score a line)."""
    if span_pooling not in SPAN_POOLINGS or (span_pooling and not shared_ranking):
        raise ValueError(f"span_pooling must be one of {SPAN_POOLINGS} (a line ranking with shared_ranking), "
                         f"got {span_pooling!r}")


def line_break_table(tokenizer, vocab_size: int) -> np.ndarray:
    """(V,) bool: whether each token's text holds a newline (a line ends after it). Ids the tokenizer
    does not know (an embedding table padded past its vocabulary) end no line."""
    known = min(vocab_size, len(tokenizer)) if hasattr(tokenizer, "__len__") else vocab_size
    table = np.zeros(vocab_size, dtype=bool)
    table[:known] = ["\n" in tokenizer.decode([token]) for token in range(known)]
    return table


def sentence_end_table(tokenizer, vocab_size: int) -> np.ndarray:
    """(V,) bool: whether each token ends a line or a sentence (its text, trailing spaces and closing
    quotes or brackets left out, ends with ".", "!" or "?")."""
    known = min(vocab_size, len(tokenizer)) if hasattr(tokenizer, "__len__") else vocab_size
    table = np.zeros(vocab_size, dtype=bool)
    texts = (tokenizer.decode([token]) for token in range(known))
    table[:known] = ["\n" in text or text.rstrip().rstrip("\"')]").endswith((".", "!", "?")) for text in texts]
    return table


_TABLES: dict[tuple[str, int, int], tuple[object, np.ndarray]] = {}  # (kind, id(tokenizer), V) -> (tokenizer, table)


def span_ends(tokenizer, vocab_size: int, pooling: str) -> np.ndarray:
    """Where a span of `pooling` may end (`line_break_table` or `sentence_end_table`), computed once per
    tokenizer (the tokenizer is kept with it, so its id stays its own)."""
    kind = "sentence" if pooling.startswith("sentence") else "line"
    key = (kind, id(tokenizer), vocab_size)
    if key not in _TABLES:
        table = sentence_end_table if kind == "sentence" else line_break_table
        _TABLES[key] = (tokenizer, table(tokenizer, vocab_size))
    return _TABLES[key][1]


def line_breaks(tokenizer, vocab_size: int) -> np.ndarray:
    """`line_break_table`, computed once per tokenizer."""
    return span_ends(tokenizer, vocab_size, "line")


@dataclass
class TextSpans:
    """One sequence's prompt cut into lines, and the scores that rank them."""

    span: np.ndarray  # (P,) int64: line index of each prompt position
    line_start: np.ndarray  # (S + 1,) int64: each line's first position, then P
    own: np.ndarray  # (P,) float32: each position's own score once scored, NaN before
    contrast_width: int = 0  # 0: rank a line by its mean; else by its contrast with this many positions around
    _ranking: "tuple[np.ndarray, np.ndarray] | None" = field(default=None, init=False, repr=False)  # float32 line_values

    @classmethod
    def of_prompt(cls, prompt_ids: "list[int] | np.ndarray", span_ends: np.ndarray, pooling: str = "line",
                  max_span: int = MAX_SPAN) -> "TextSpans":
        """`span_ends`: (V,) whether a span may end after each token (`span_ends(tokenizer, V, pooling)`)."""
        check_span_pooling(pooling, shared_ranking=True)
        ends = span_ends[np.asarray(prompt_ids, np.int64)]  # (P,) the span ends after this token
        text_line = np.concatenate([[0], np.cumsum(ends[:-1], dtype=np.int64)]) if len(ends) else ends.astype(np.int64)
        offset = np.arange(len(ends)) - np.searchsorted(text_line, text_line)  # (P,) place in its text line
        span = np.cumsum(offset % max_span == 0) - 1  # (P,) a span starts each text line and every max_span tokens of it
        lines = int(span[-1]) + 1 if len(span) else 0
        line_start = np.searchsorted(span, np.arange(lines + 1))  # (lines + 1,) each line's first position, then P
        return cls(span, line_start, np.full(len(ends), np.nan, np.float32),
                   CONTRAST_WIDTH if pooling.endswith("_contrast") else 0)

    @property
    def prompt_length(self) -> int:
        return len(self.span)

    def add_scores(self, positions: np.ndarray, scores: np.ndarray) -> None:
        """Record the scores (M,) of positions (M,) that just left the window (each is scored once)."""
        inside = (positions >= 0) & (positions < self.prompt_length)
        positions, scores = positions[inside], scores[inside]
        fresh = np.isnan(self.own[positions])
        self.own[positions[fresh]] = scores[fresh]
        if fresh.any():
            self._ranking = None

    def line_values(self) -> tuple[np.ndarray, np.ndarray]:
        """(S,) each line's mean score so far, and (S,) the value it is ranked by."""
        scored = ~np.isnan(self.own)
        total = np.concatenate([[0.0], np.cumsum(np.where(scored, self.own, 0.0))])  # (P + 1,) prefix sums
        count = np.concatenate([[0], np.cumsum(scored)])
        start, stop = self.line_start[:-1], self.line_start[1:]
        mean = (total[stop] - total[start]) / np.maximum(count[stop] - count[start], 1)
        if not self.contrast_width:
            return mean, mean
        half = self.contrast_width // 2
        before, after = np.maximum(start - half, 0), np.minimum(stop + half, self.prompt_length)
        around_sum = total[start] - total[before] + total[after] - total[stop]
        around_count = count[start] - count[before] + count[after] - count[stop]
        prompt_mean = total[-1] / max(count[-1], 1)
        contrast = mean - around_sum / np.maximum(around_count, 1) + prompt_mean
        return mean, np.where(around_count > 0, contrast, mean)

    def priority(self, positions: np.ndarray, current: np.ndarray) -> np.ndarray:
        """The pooled priority of `positions` (any shape); `current` where a position has no pooled
        one (not in the prompt, or not scored by this cache's spans)."""
        inside = (positions >= 0) & (positions < self.prompt_length)
        index = np.where(inside, positions, 0)
        own = self.own[index]
        line = self.span[index]
        if self._ranking is None:  # once per append: an append ranks its leaving tokens and the held ones
            self._ranking = tuple(values.astype(np.float32) for values in self.line_values())
        mean, value = self._ranking
        pooled = value[line] + np.float32(OWN_SHARE) * (own - mean[line])
        return np.where(inside & ~np.isnan(own), pooled, current).astype(np.float32)

    def segment_max(self, values: np.ndarray) -> np.ndarray:
        """(..., P) -> (..., P): each prompt position takes the largest value of its span."""
        if not self.prompt_length:
            return values
        return np.maximum.reduceat(values, self.line_start[:-1], axis=-1)[..., self.span]
