"""A sequence's output text, built token by token: complete characters only, cut before a stop string.

A token can end in the middle of a multi-byte character (byte-level BPE); decoding it alone gives
U+FFFD. Following TGI/vLLM, text is decoded over a short window of recent tokens and grows only by
text that does not end in a replacement character.

Stop strings are matched here, on the text the client gets (as vLLM's detokenizer does), so the engine
stops where the text says and every route returns the same answer: the text before the first stop
string, never the stop string nor the rest of the token that completed it. While a sequence streams,
the text's tail that could still begin a stop string is held back until it is known not to be one.
"""

from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(self, tokenizer, stop: tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.token_ids: list[int] = []
        self.text = ""  # the output's text so far (cut before the stop string once one is found)
        self.matched_stop: str | None = None
        self.prefix_offset = 0  # start of the decoding window
        self.read_offset = 0  # tokens before this are in `text`
        self.released = 0  # characters of `text` handed out by `take`

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def push(self, token_id: int) -> str | None:
        """Add one token; return the stop string its text completed, if any (the text ends before it)."""
        self.token_ids.append(token_id)
        if self.matched_stop is not None:
            return self.matched_stop
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.token_ids[self.prefix_offset :])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
            self._extend(new_text[len(prefix_text) :])
        return self.matched_stop

    def flush(self) -> None:
        """End of the sequence: whatever is still undecoded (an incomplete character at the very end)."""
        if self.matched_stop is None:
            prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
            self._extend(self._decode(self.token_ids[self.prefix_offset :])[len(prefix_text) :])
        self.prefix_offset = self.read_offset = len(self.token_ids)

    def take(self, final: bool = False) -> str:
        """The text not handed out yet, less (unless `final`) a tail that could begin a stop string."""
        end = len(self.text) if final or self.matched_stop is not None else len(self.text) - self._held_back()
        if end <= self.released:
            return ""
        piece, self.released = self.text[self.released : end], end
        return piece

    def _extend(self, new_text: str) -> None:
        """Append decoded text; on a stop string cut the text where the first one begins."""
        searched_from = len(self.text)
        self.text += new_text
        starts = [start for stop in self.stop
                  if (start := self.text.find(stop, max(0, searched_from - len(stop) + 1))) >= 0]
        if starts:
            start = min(starts)
            self.matched_stop = next(stop for stop in self.stop if self.text.startswith(stop, start))
            self.text = self.text[:start]

    def _held_back(self) -> int:
        """Characters at the end of the unreleased text that are the beginning of some stop string."""
        tail = self.text[self.released :]
        longest = 0
        for stop in self.stop:
            start = max(0, len(tail) - len(stop) + 1)
            while (start := tail.find(stop[0], start)) >= 0 and len(tail) - start > longest:
                if stop.startswith(tail[start:]):
                    longest = len(tail) - start
                    break
                start += 1
        return longest
