"""What runs in an engine step: which waiting requests join the running batch, the prompt-token budget,
chunk sizes, whole-prompt prefill, pacing, and whether the decode step shares a call with prompt work.

As vLLM's scheduler owns its waiting queue and admits by free KV blocks, the scheduler owns the one
waiting queue (kvpop.engine.admission): a request is read once into its plan by the cache manager
(`read`), and each step `admit`s, first come first served, those whose KV memory the manager reserves
and the running batch has room for (`max_batch_size`).

As vLLM's scheduler interleaves chunked prefill with decode: every step runs ONE decode step of the
sequences whose prompt is in, and prompt work of the admitted ones under a token budget
(`EngineConfig.max_step_tokens`, or paced to the measured decode step: kvpop.engine.prefill_pacer),
so a long new prompt stalls the running streams for one step's share of its prefill, not for all of
it. A prompt's chunk size is fixed by the request alone (`chunk_size`), so outputs never depend on what
else is running; a chunk cut into pieces by the budget enters its cache once, whole
(kvpop.kvtypes.StagedChunk). When no policy in the step reads attention, the decode step and the
step's first prompt pieces run as one mixed call (the weights are read once for both).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

from kvpop.engine.admission import AdmissionPolicy, Pending, WaitingQueue
from kvpop.engine.config import EngineConfig
from kvpop.engine.prefill_pacer import PrefillPacer
from kvpop.request import GenerationRequest

if TYPE_CHECKING:
    from kvpop.cache.manager import CacheManager
    from kvpop.cache.slot_cache import SlotCache
    from kvpop.engine.sequence import Sequence
    from kvpop.policies import EvictionPolicy

MIN_PIECE_TOKENS = 16  # a step's budget left over after other prompt work starts no smaller piece


def reads_attention(sequences: "Iterable[Sequence]") -> bool:
    """Whether a decoder call for `sequences` must return attention (a policy among them reads it)."""
    return any(sequence.cache.policy.needs_attention for sequence in sequences)


class Scheduler:
    def __init__(self, config: EngineConfig, has_mixed_step: bool, manager: "CacheManager") -> None:
        self.config = config
        self.has_mixed_step = has_mixed_step  # the export has the decode + prompt call (DecoderStep.run_mixed)
        self.pacer = PrefillPacer(config.prefill_pacing) if config.prefill_pacing else None
        self.manager = manager
        self.waiting = WaitingQueue(manager, AdmissionPolicy(config.min_kv_budget, config.max_queue_size))

    # -- admission: what joins the running batch -------------------------------------------------

    def read(self, request: GenerationRequest, prefilled: "tuple[SlotCache, int] | None" = None) -> Pending:
        """The request read once: its plan, the cache manager's one reading of its cache configuration."""
        return Pending(request, self.manager.plan(request, self.config.min_kv_budget, self.prefills_whole), prefilled)

    def admit(self, running: int) -> list[Pending]:
        """Reserve KV memory for the waiting requests in order, and take the reserved ones the running batch
        (`running` sequences now) has room for. Called under the engine's lock."""
        self.waiting.admit()
        return self.waiting.take(self.config.max_batch_size - running)

    # -- chunk sizing: fixed by the request alone ------------------------------------------------

    def prefills_whole(self, policy: "EvictionPolicy", budget: int | None, prompt_left: int) -> bool:
        """Whether this bounded cache takes its prompt in one chunk (`whole_prompt_tokens`)."""
        return budget is not None and not policy.needs_attention and 0 < prompt_left <= self.config.whole_prompt_tokens

    def evicting_chunk(self, budget: int | None) -> int:
        """Prompt tokens per chunk of a cache that evicts while prefilling: at most max(budget,
        `min_bounded_chunk`), so no query sees more than budget cached + that many new tokens (with the
        default floor of 1: budget + budget). A service raises the floor: a 16-slot budget would otherwise
        prefill a 100-token chat in seven calls; the cache it keeps is still `budget` slots."""
        if budget is None:
            return self.config.prefill_chunk
        return min(self.config.prefill_chunk, max(budget, self.config.min_bounded_chunk))

    def chunk_size(self, policy: "EvictionPolicy", budget: int | None, prompt_left: int) -> int:
        if self.prefills_whole(policy, budget, prompt_left):
            return prompt_left
        return self.evicting_chunk(budget)

    def query_window(self, policy: "EvictionPolicy", budget: int | None, prompt_left: int, cached: int) -> int:
        """The prompt's last tokens whose queries the policy reads (`EvictionPolicy.query_window`), when it
        takes the prompt whole and must evict then (`cached` slots already held); else 0."""
        evicts = budget is not None and cached + prompt_left > budget
        return min(policy.query_window, prompt_left) if evicts and self.prefills_whole(policy, budget, prompt_left) else 0

    # -- one step's work -------------------------------------------------------------------------

    def step_budget(self, decoding: bool) -> int:
        """Prompt tokens this step may feed: `max_step_tokens` while streams decode (the longest a running
        stream waits for prompt work between two of its tokens; paced, when configured), at least one
        whole `prefill_chunk` when none does."""
        ceiling = self.config.step_tokens
        if not decoding:
            return max(ceiling, self.config.prefill_chunk)
        return ceiling if self.pacer is None else self.pacer.step_tokens(ceiling)

    @staticmethod
    def piece_reads_attention(sequences: "list[Sequence]") -> bool:
        """Whether a prompt call for `sequences` must return attention (a policy reads it, or a piece is a
        prompt's query window)."""
        return reads_attention(sequences) or any(sequence.reads_query for sequence in sequences)

    def mixes(self, decoding: "list[Sequence]") -> bool:
        """Whether this step's decode may share a call with prompt work (no cache in it reads attention)."""
        return bool(decoding) and self.has_mixed_step and not reads_attention(decoding)

    @staticmethod
    def next_round(prefilling: "Iterable[Sequence]", budget: int, used: int) -> "tuple[dict[int, list[Sequence]], int]":
        """One round of prompt work, first come first served: the next piece of every prompt (the rest of
        its current chunk, cut to what is left of the budget), grouped by length (one batched call each);
        and the budget used after it. Empty: what is left is too small to start any piece.

        A prompt's query window (`Sequence.reads_query`) is never cut: the policy reads the attention of the
        window's piece alone, so a window cut at a step's end would leave the question's picks to its last
        few tokens (the chat template's). It waits for the next step, or, as a step's first piece, goes whole
        past the budget (it is a few dozen tokens)."""
        pieces: dict[int, list[Sequence]] = {}
        for sequence in prefilling:
            length = min(sequence.piece_left, budget - used)
            if sequence.reads_query and length < sequence.piece_left:
                if used:
                    break
                length = sequence.piece_left
            if length <= 0 or used and length < min(sequence.piece_left, MIN_PIECE_TOKENS):
                break  # no sliver of a chunk after other work: a call costs more than its tokens
            pieces.setdefault(length, []).append(sequence)
            used += length
        return pieces, used

    # -- pacing ----------------------------------------------------------------------------------

    def observe_decode(self, seconds: float) -> None:
        """A decode step alone took `seconds`: what the pacer sizes prompt work by."""
        if self.pacer is not None:
            self.pacer.observe_decode(seconds)

    def observe_prompt_work(self, seconds: float, tokens: int, shared_decode: bool) -> None:
        """A step's prompt work beside decodes took `seconds` for `tokens` (`shared_decode`: the decode ran
        in the same call, and its usual share is taken off)."""
        if self.pacer is None or not tokens:
            return
        if shared_decode and self.pacer.decode_seconds is not None:
            seconds -= self.pacer.decode_seconds
        self.pacer.observe_prefill(seconds, tokens)
