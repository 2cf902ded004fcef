"""Prompt chunks computed in pieces, held beside their caches until whole (kvpop.kvtypes.StagedChunk),
and the decoder's past arrays for a prompt call: part of the cache manager's memory.

A chunk's keys and values go into one buffer of the whole chunk's length as its pieces arrive (a
2,048-token prompt entering whole is eight pieces: stacking them anew for every piece would copy the
prompt about four times over); only a policy that reads the pieces' attention has them stacked with it."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from kvpop.cache.slot_cache import SlotCache
from kvpop.kvtypes import StagedChunk
from kvpop.model_spec import ModelSpec

if TYPE_CHECKING:
    from kvpop.decoder import StepOutput


def append_output(cache: SlotCache, out: "StepOutput", row: int) -> None:
    """Append row `row` of a decoder step's new tokens (and the attention its policy reads) to `cache`."""
    attention = None if out.attention is None else out.attention[:, row]
    chunk_attention = None if out.chunk_attention is None else out.chunk_attention[:, row]
    cache.append(out.new_key[:, row], out.new_value[:, row], attention, chunk_attention)


class PromptStaging:
    def __init__(self, spec: ModelSpec) -> None:
        self.spec = spec
        self.dtype = np.dtype(spec.dtype)
        self._staged: dict[str, StagedChunk] = {}  # request id -> its current chunk's pieces so far
        self._buffers: dict[str, tuple[np.ndarray, np.ndarray]] = {}  # request id -> (L, Hkv, chunk, D) keys, values

    def length(self, request_id: str) -> int:
        piece = self._staged.get(request_id)
        return 0 if piece is None else piece.length

    @property
    def nbytes(self) -> int:
        return sum(piece.nbytes for piece in self._staged.values())

    def drop(self, request_id: str) -> None:
        self._staged.pop(request_id, None)
        self._buffers.pop(request_id, None)

    def inputs(self, caches: list[SlotCache], request_ids: list[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(past_key, past_value, slot_mask) for a prompt chunk (or piece) of `caches`: (L, B, Hkv, S, D)
        twice, (B, S): one cache's own arrays (no copy) or stacked copies padded to the largest, each
        row's chunk computed so far as valid slots after its cache's."""
        staged = [self._staged.get(request_id) for request_id in request_ids]
        extra = [0 if piece is None else piece.length for piece in staged]
        if len(caches) == 1 and not extra[0]:  # the cache's own arrays, no copy
            cache = caches[0]
            return cache.key[:, None], cache.value[:, None], cache.slot_mask()[None]
        slots = max(cache.capacity + more for cache, more in zip(caches, extra))  # stacked and padded (padding is masked)
        shape = (self.spec.num_layers, len(caches), self.spec.num_kv_heads, slots, self.spec.head_dim)
        allocate = np.empty if len(caches) == 1 else np.zeros  # one row is written whole; padding must be zeros
        past_key, past_value, slot_mask = allocate(shape, self.dtype), allocate(shape, self.dtype), np.zeros((len(caches), slots), bool)
        for row, (cache, more) in enumerate(zip(caches, extra)):
            past_key[:, row, :, : cache.capacity] = cache.key
            past_value[:, row, :, : cache.capacity] = cache.value
            slot_mask[row, : cache.capacity] = cache.slot_mask()
            if more:
                piece = staged[row]
                if piece.capacity != cache.capacity:
                    raise RuntimeError("a cache changed while its prompt chunk was staged")
                past_key[:, row, :, cache.capacity : cache.capacity + more] = piece.key
                past_value[:, row, :, cache.capacity : cache.capacity + more] = piece.value
                slot_mask[row, cache.capacity : cache.capacity + more] = True
        return past_key, past_value, slot_mask

    def store(self, caches: list[SlotCache], request_ids: list[str], chunk_lengths: list[int], out: "StepOutput") -> None:
        """Row r of a prompt call (a whole chunk or a piece of one): staged after the row's earlier pieces
        (the policy sees the piece: `EvictionPolicy.stage`), and appended to caches[r] with them once
        its chunk of `chunk_lengths[r]` tokens is whole. A cache that evicts nothing takes every piece as
        it comes (appending it now is what appending the whole chunk later would do)."""
        length = out.new_key.shape[3]
        for row, (cache, request_id, chunk_length) in enumerate(zip(caches, request_ids, chunk_lengths)):
            piece = self._staged.pop(request_id, None)
            done = (0 if piece is None else piece.length) + length == chunk_length or not cache.policy.evicts
            # The piece that ends a whole prompt of a policy that reads its last queries (`query_window`): the
            # engine ran it alone with attention (Sequence.piece_left), so its queries are those last tokens.
            reads_query = done and cache.policy.query_window > 0 and out.attention is not None
            if piece is None and done:
                if reads_query:  # the chunk in one call: its queries on the cache's slots, then on the chunk
                    query = np.concatenate([out.attention[:, row][..., : cache.capacity], out.chunk_attention[:, row]], axis=-1)
                    cache.append(out.new_key[:, row], out.new_value[:, row], None, None, query_attention=query)
                else:
                    append_output(cache, out, row)
                continue
            key, value = out.new_key[:, row], out.new_value[:, row]  # (L, Hkv, t, D)
            attention = None if out.attention is None else out.attention[:, row]  # (L, Hq, t, S)
            chunk_attention = None if out.chunk_attention is None else out.chunk_attention[:, row]
            piece = self._with_piece(request_id, piece, cache.capacity, chunk_length, key, value, attention, chunk_attention)
            cache.policy.stage(cache, piece, slice(piece.length - length, piece.length), chunk_length)
            if done:
                query = piece.query_attention(out.attention[:, row], out.chunk_attention[:, row]) if reads_query else None
                cache.append(piece.key, piece.value, piece.attention, piece.chunk_attention, query_attention=query)
                self._buffers.pop(request_id, None)
            else:
                self._staged[request_id] = piece

    def _with_piece(self, request_id: str, piece: StagedChunk | None, capacity: int, chunk_length: int, key: np.ndarray,
                    value: np.ndarray, attention: np.ndarray | None, chunk_attention: np.ndarray | None) -> StagedChunk:
        """The chunk's pieces so far and this one (`key`, `value`: (L, Hkv, t, D)). Without staged attention
        they are views of the chunk's buffer, the new piece written after the others; with it, stacked."""
        if piece is None and attention is not None:  # a policy reads the pieces' attention: StagedChunk stacks it all
            return StagedChunk.first(capacity, key, value, attention, chunk_attention)
        if piece is not None and piece.attention is not None:
            piece.add(key, value, attention, chunk_attention)
            return piece
        start = 0 if piece is None else piece.length
        if request_id not in self._buffers:  # the chunk's first piece, or the first after pieces stacked with attention
            shape = (self.spec.num_layers, self.spec.num_kv_heads, chunk_length, self.spec.head_dim)
            self._buffers[request_id] = (np.empty(shape, self.dtype), np.empty(shape, self.dtype))
            if piece is not None:
                self._buffers[request_id][0][:, :, :start], self._buffers[request_id][1][:, :, :start] = piece.key, piece.value
        key_buffer, value_buffer = self._buffers[request_id]
        stop = start + key.shape[2]
        key_buffer[:, :, start:stop], value_buffer[:, :, start:stop] = key, value
        if piece is None:
            return StagedChunk(capacity, key_buffer[:, :, :stop], value_buffer[:, :, :stop], None, None)
        piece.key, piece.value = key_buffer[:, :, :stop], value_buffer[:, :, :stop]
        return piece

