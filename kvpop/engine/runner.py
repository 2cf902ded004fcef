"""The decoder calls of a step: prompt pieces, decode steps and the mixed call, with the cache
manager's arrays in and the new keys and values back into the caches. Sampling is the engine's."""

from __future__ import annotations

import numpy as np

from kvpop.cache.manager import CacheManager
from kvpop.decoder import DecoderStep, StepInputs, StepOutput
from kvpop.engine.scheduler import Scheduler, reads_attention
from kvpop.engine.sequence import Sequence


class ModelRunner:
    def __init__(self, decoder: DecoderStep, cache_manager: CacheManager) -> None:
        self.decoder = decoder
        self.cache_manager = cache_manager

    def prompt_piece(self, sequences: list[Sequence], length: int) -> StepOutput:
        """The next `length` prompt tokens of each sequence (at most the rest of its current chunk)
        through one decoder call, after its cache and its chunk's staged pieces. A sequence whose chunk
        this completes has it appended to its cache; otherwise the piece is staged."""
        attention = Scheduler.piece_reads_attention(sequences)
        out = self.decoder.run(*self._piece_inputs(sequences, length), last_only=True, attention=attention)
        self._store_piece(sequences, length, out)
        return out

    def whole_prompt(self, sequence: Sequence) -> StepOutput:
        """The rest of one sequence's prompt, alone, chunk by chunk; the last chunk's output."""
        while sequence.prompt_left:
            out = self.prompt_piece([sequence], sequence.piece_left)
        return out

    def decode(self, sequences: list[Sequence]) -> StepOutput:
        """One decode step of `sequences` in its own call; their new tokens are in their caches after it."""
        out = self.decoder.run(*self._decode_inputs(sequences), last_only=True, attention=reads_attention(sequences))
        self.cache_manager.store_decode([sequence.cache for sequence in sequences], out)
        return out

    def mixed(self, decoding: list[Sequence], sequences: list[Sequence], length: int) -> tuple[StepOutput, StepOutput]:
        """The decode step of `decoding` and a prompt piece of `sequences` in one (mixed) decoder call."""
        decode_out, piece_out = self.decoder.run_mixed(self._decode_inputs(decoding), self._piece_inputs(sequences, length))
        self._store_piece(sequences, length, piece_out)
        self.cache_manager.store_decode([sequence.cache for sequence in decoding], decode_out)
        return decode_out, piece_out

    def _piece_inputs(self, sequences: list[Sequence], length: int) -> StepInputs:
        starts = [sequence.prefilled for sequence in sequences]
        input_ids = np.array([sequence.request.prompt_ids[start : start + length] for sequence, start in zip(sequences, starts)], np.int64)
        positions = np.array([np.arange(start, start + length) for start in starts], np.int64)  # (B, T)
        past_key, past_value, slot_mask = self.cache_manager.prefill_inputs([sequence.request_id for sequence in sequences])
        return StepInputs(input_ids, positions, past_key, past_value, slot_mask)

    def _store_piece(self, sequences: list[Sequence], length: int, out: StepOutput) -> None:
        chunk_lengths = [sequence.staged_tokens + sequence.chunk_left for sequence in sequences]
        self.cache_manager.store_pieces([sequence.request_id for sequence in sequences], chunk_lengths, out)
        for sequence in sequences:
            sequence.staged_tokens = self.cache_manager.staged_tokens(sequence.request_id)
            sequence.prefilled += length

    def _decode_inputs(self, sequences: list[Sequence]) -> StepInputs:
        caches = [sequence.cache for sequence in sequences]
        past_key, past_value, slot_mask = self.cache_manager.decode_inputs(caches)  # the pool's arrays, no copy
        input_ids = np.array([[sequence.pending_token] for sequence in sequences], dtype=np.int64)  # (B, 1)
        positions = np.array([[cache.tokens_seen] for cache in caches], dtype=np.int64)  # (B, 1)
        return StepInputs(input_ids, positions, past_key, past_value, slot_mask)
