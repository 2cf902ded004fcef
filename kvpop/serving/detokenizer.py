"""Incremental detokenization for streaming: emit text only once it is complete.

A token can end in the middle of a multi-byte character (byte-level BPE); decoding it alone gives
U+FFFD. Following TGI/vLLM, text is decoded over a short window of recent tokens and a delta is
released only when it does not end in a replacement character.
"""

from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.token_ids: list[int] = []
        self.prefix_offset = 0  # start of the decoding window
        self.read_offset = 0  # tokens before this have been emitted as text

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def push(self, token_id: int) -> str:
        """Add one token; return the newly completed text (possibly empty)."""
        self.token_ids.append(token_id)
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.token_ids[self.prefix_offset :])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
            return new_text[len(prefix_text) :]
        return ""

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the very end)."""
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.token_ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.token_ids)
        return new_text[len(prefix_text) :]
