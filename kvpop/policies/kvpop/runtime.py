"""The learned scorer at serve time: the exported ONNX step run by onnxruntime (no torch).

`ScorerRuntime` owns the session and is shared by every sequence; each sequence's recurrent state is
a `ScorerState` that `init_state` returns and the slot cache keeps as the kvpop policy's state
(`cache.policy_state`), so saving and restoring a cache saves and restores its scorer too.
`LearnedScorer` adapts the runtime to the kvpop policy's `TokenScorer` interface.
A prompt's pieces go through the memory on the runtime's worker thread while the engine runs the next piece
through the decoder (onnxruntime releases the GIL): the same calls in the same order, off the engine's path.
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort

from kvpop.kvtypes import StatisticsUpdate
from kvpop.policies.kvpop.scorer_spec import ScorerSpec
from kvpop.policies.kvpop.scorers import LeavingTokens, TokenScorer

MAX_CHUNK = 64  # rows per ONNX call: the chunk's (T x T) intra-chunk weights stay small in a prefill


@dataclass
class ScorerState:
    """One sequence's scorer state: the recurrent memory, and the tokens not yet taken into it.

    While a prompt chunk is computed in pieces (kvpop.kvtypes.StagedChunk), `staged` holds the scores
    of the leaving tokens its pieces took in so far (a Future while its piece runs on the runtime's
    worker, which also writes `recurrent`: `settle` first); the chunk's append then only looks them up.
    Between appends (when a state is saved or copied) it is None."""

    recurrent: dict[str, np.ndarray]  # state name -> (L, Hkv, ...) float32; empty when stateless
    pending_key: np.ndarray  # (L, Hkv, P, D) tokens of the last append, consumed at the next score
    pending_value: np.ndarray  # (L, Hkv, P, D)
    staged: "list[tuple[np.ndarray, np.ndarray | Future]] | None" = None  # per piece: leaving positions (m,), scores (L, Hkv, m)

    def settle(self) -> None:
        """Wait for the pieces still running on the worker: their scores in `staged`, the memory after them."""
        if self.staged:
            self.staged = [(positions, scores.result() if isinstance(scores, Future) else scores) for positions, scores in self.staged]

    def copy(self) -> "ScorerState":
        self.settle()
        return ScorerState(
            {name: array.copy() for name, array in self.recurrent.items()},
            self.pending_key.copy(), self.pending_value.copy(),
            None if self.staged is None else list(self.staged),
        )


class ScorerRuntime:
    """The exported scorer of one kind (`scorer_<kind>.onnx` + `.json` in `directory`)."""

    def __init__(self, directory: Path, kind: str = "mlstm", threads: int | None = None) -> None:
        self.spec = ScorerSpec.load(Path(directory) / f"scorer_{kind}.json")
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads or int(os.environ.get("KVPOP_SCORER_THREADS", "1"))
        self.session = ort.InferenceSession(
            str(Path(directory) / self.spec.onnx_file), sess_options=options, providers=["CPUExecutionProvider"]
        )
        # One thread for prompt pieces (`beside`): a sequence's pieces run in order, each on the memory the last left.
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"kvpop-scorer-{kind}")
        self.decode_session = None  # scorer_<kind>.decode.onnx: B sequences' decode steps in one call
        self._last_decode: tuple[list[dict[str, np.ndarray]], list[np.ndarray]] | None = None  # states out, stacked
        if self.spec.decode_onnx_file and (Path(directory) / self.spec.decode_onnx_file).exists():
            self.decode_session = ort.InferenceSession(
                str(Path(directory) / self.spec.decode_onnx_file), sess_options=options, providers=["CPUExecutionProvider"]
            )

    def beside(self, work) -> Future:
        """Run `work()` on the worker thread, after the work handed to it before."""
        return self._worker.submit(work)

    @staticmethod
    def available(directory: Path) -> list[str]:
        """Kinds exported into `directory` (what the engine may offer as kvpop scorers)."""
        return sorted(path.stem.removeprefix("scorer_") for path in Path(directory).glob("scorer_*.json"))

    def initial_state(self) -> ScorerState:
        spec = self.spec
        empty = np.zeros((spec.num_layers, spec.num_kv_heads, 0, spec.head_dim), np.float32)
        recurrent = {name: np.zeros(shape, np.float32) for name, shape in spec.state_shapes.items()}
        return ScorerState(recurrent, empty, empty.copy())

    def step(
        self,
        recurrent: dict[str, np.ndarray],  # state name -> (L, Hkv, ...)
        new_key: np.ndarray,  # (L, Hkv, T, D) RoPE applied
        new_value: np.ndarray,  # (L, Hkv, T, D)
        leaving_key: np.ndarray,  # (L, Hkv, T, D): row t leaves the window when new token t arrives
        leaving_value: np.ndarray,  # (L, Hkv, T, D)
        leaving_attention: np.ndarray | None = None,  # (L, Hkv, T) log relative in-window attention
    ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """Take T tokens into the memory; score each row's leaving token. -> ((L, Hkv, T), new state)."""
        tokens = dict(new_key=new_key, new_value=new_value, leaving_key=leaving_key, leaving_value=leaving_value)
        if self.spec.attention_feature:
            tokens["leaving_attention"] = leaving_attention
        state_names = list(self.spec.state_shapes)
        scores = []
        for begin in range(0, new_key.shape[2], MAX_CHUNK):
            rows = slice(begin, begin + MAX_CHUNK)
            feed = {name: np.ascontiguousarray(tokens[name][:, :, rows], np.float32)
                    for name in self.spec.inputs if name in tokens}
            feed.update(recurrent)
            score, *new_state = self.session.run(None, feed)
            recurrent = dict(zip(state_names, new_state))
            scores.append(score)
        if not scores:
            return np.zeros((*new_key.shape[:2], 0), np.float32), recurrent
        return self._ranked(np.concatenate(scores, axis=2)), recurrent


    def step_decode_batch(
        self,
        recurrents: list[dict[str, np.ndarray]],  # B states, name -> (L, Hkv, ...)
        tokens: tuple[np.ndarray, ...],  # new_key, new_value, leaving_key, leaving_value: (B, L, Hkv, D)
    ) -> tuple[np.ndarray, list[dict[str, np.ndarray]]]:
        """One decode step (one new token, one leaving token) of B sequences in one call of the decode
        graph, the sequences in its token axis. -> ((B, L, Hkv) scores, B new states).

        The new states are views of the call's (L, Hkv, B, ...) outputs; when the next call gets
        exactly those states back (the same batch decoding on), it feeds the outputs as they are
        instead of stacking B states again."""
        feed = dict(zip(("new_key", "new_value", "leaving_key", "leaving_value"),
                        (np.ascontiguousarray(array.transpose(1, 2, 0, 3), np.float32) for array in tokens)))
        names = list(self.spec.state_shapes)
        feed.update(zip(names, self._stacked_states(recurrents)))
        score, *new_state = self.decode_session.run(None, feed)  # (L, Hkv, B), (L, Hkv, B, ...) each
        states = [{name: state[:, :, row] for name, state in zip(names, new_state)} for row in range(len(recurrents))]
        self._last_decode = (states, new_state)
        return self._ranked(score).transpose(2, 0, 1), states

    def _ranked(self, scores: np.ndarray) -> np.ndarray:
        """(L, Hkv, T) scores as the policy ranks them. Every call pairs row t with one leaving token for
        all heads (the one leaving when token t arrives), so with a shared ranking the mean over the caches
        is that token's score everywhere: every head then evicts the same tokens, slot for slot."""
        if not self.spec.shared_ranking:
            return scores
        return np.broadcast_to(scores.mean(axis=(0, 1), keepdims=True, dtype=np.float32), scores.shape).copy()

    def _stacked_states(self, recurrents: list[dict[str, np.ndarray]]) -> list[np.ndarray]:
        """The B states side by side, (L, Hkv, B, ...) per name: the last decode call's outputs when
        these are exactly the states it returned (same arrays, same order), else stacked anew."""
        if self._last_decode is not None:
            states, outputs = self._last_decode
            if len(states) == len(recurrents) and all(
                recurrent[name] is state[name] for recurrent, state in zip(recurrents, states) for name in state
            ):
                return outputs
        return [np.stack([recurrent[name] for recurrent in recurrents], axis=2) for name in self.spec.state_shapes]


class LearnedScorer(TokenScorer):
    """The trained network as a kvpop `TokenScorer` (one instance per engine, shared by sequences).

    The policy calls `observe` with every append and `score` only when tokens leave the window, after
    the leaving tokens are gathered. A token leaving at new token t must be read from the memory after
    the memory took in t (as in training), so `observe` only holds the append's tokens back and
    `score` runs them through the memory together with their leaving tokens, row by row. The leaving
    tokens of an append (positions [first, stop)) leave at its last M arrivals; anything not scored
    (nothing left) is taken in, with no reads, at the next append.

    With the attention feature, it keeps its own per-slot statistic as the traces define it: attention
    received from the queries up to w tokens later, each probability times the keys its query saw
    (valid slots + its place in the chunk). The policy protects the window it was trained for
    (at a tight budget a smaller one, which pairs each token with an earlier state; docs/QUALITY.md).
    """

    name = "learned"
    ATTENTION = "relative_window_attention"

    def __init__(self, runtime: ScorerRuntime) -> None:
        self.runtime = runtime
        self.statistics = (self.ATTENTION,) if runtime.spec.attention_feature else ()
        self.needs_attention = runtime.spec.attention_feature

    @classmethod
    def load(cls, directory: Path, kind: str = "mlstm", threads: int | None = None) -> "LearnedScorer":
        return cls(ScorerRuntime(directory, kind, threads))

    @property
    def window(self) -> int:
        """The window the scorer was trained for; the kvpop policy protects the same (less at a tight budget)."""
        return self.runtime.spec.window

    def init_state(self) -> ScorerState:
        return self.runtime.initial_state()

    @property
    def span_pooling(self) -> str:
        return self.runtime.spec.span_pooling

    @property
    def shared_ranking(self) -> bool:
        return self.runtime.spec.shared_ranking

    @property
    def retrieval_heads(self) -> "np.ndarray | None":
        heads = self.runtime.spec.retrieval_heads
        return np.array(heads, np.int64).reshape(-1, 2) if heads else None

    @property
    def takes_pieces(self) -> bool:
        """Whether a chunk computed in pieces may go through the memory piece by piece (`take_piece`):
        not with the attention feature, whose statistic needs the whole chunk's attention."""
        return not self.statistics

    @property
    def catches_up(self) -> bool:
        """Reads keys and values only (no attention feature): a cache's history can come late."""
        return not self.statistics

    def take_piece(self, state: ScorerState, new_key: np.ndarray, new_value: np.ndarray,
                   leaving_positions: np.ndarray, leaving_key: np.ndarray, leaving_value: np.ndarray) -> None:
        """Run a chunk's piece through the memory now, beside the engine's next decoder call (the runtime's
        worker; the arrays must stay as they are until `settle`), rows paired with their leaving tokens
        exactly as the whole chunk's append would pair them, and keep those tokens' scores for it (`score`):
        a chunk computed over several engine steps then costs its completing step no scorer work."""
        if state.staged is None:  # the chunk's first piece: what the previous append held back goes first
            self._consume(state, leaving=None)
            state.staged = []
        rows = leaving_positions >= 0

        def run() -> np.ndarray:  # (L, Hkv, m): on the worker, after this sequence's earlier pieces
            scores, state.recurrent = self.runtime.step(state.recurrent, new_key, new_value, leaving_key, leaving_value,
                                                        np.zeros(new_key.shape[:3], np.float32))
            return scores[:, :, rows]

        state.staged.append((leaving_positions[rows], self.runtime.beside(run)))

    def observe(self, cache, state: ScorerState, update) -> StatisticsUpdate:
        if state.staged is not None:  # the chunk's pieces are in the memory already (take_piece)
            state.settle()
            if not any(len(positions) for positions, _ in state.staged):  # no token leaves: score is not called
                state.staged = None
            return StatisticsUpdate()
        self._consume(state, leaving=None)
        state.pending_key = np.array(update.key, np.float32)  # a copy: the caller may reuse its buffers
        state.pending_value = np.array(update.value, np.float32)
        if not self.statistics:
            return StatisticsUpdate()
        visible = (cache.length + np.arange(update.num_tokens) + 1).astype(np.float32)  # keys query i saw
        # Only queries up to w after a token count (a chunk's later queries come after it left).
        query = update.positions[:, None]  # (T, 1)
        old = query <= cache.position[:, :, None, :] + self.window  # (L, Hkv, T, C)
        new = query <= update.positions[None, :] + self.window  # (T, T)
        # (L, Hkv, G, T, C|T) -> (L, Hkv, C|T): summed over the new queries and the query heads of the group.
        received = np.einsum("lhgtc,lhtc,t->lhc", update.attention, old, visible)
        return StatisticsUpdate(
            new={self.ATTENTION: np.einsum("lhgts,ts,t->lhs", update.chunk_attention, new, visible)},
            cached={self.ATTENTION: cache.statistics[self.ATTENTION] + received},
        )

    def score(self, cache, state: ScorerState, leaving: LeavingTokens) -> np.ndarray:
        if state.staged is not None:  # scored when their pieces went in: look each head's up by position
            state.settle()
            positions = np.concatenate([piece_positions for piece_positions, _ in state.staged])  # (M,) ascending
            scores = np.concatenate([piece_scores for _, piece_scores in state.staged], axis=2)  # (L, Hkv, M)
            state.staged = None
            index = np.searchsorted(positions, leaving.positions)  # (L, Hkv, M): each head's order
            return np.take_along_axis(scores, index, axis=2)
        if leaving.positions.shape[2] == 1:  # a decode step: one token leaves, nothing to order
            return self._consume(state, leaving)
        # Heads hold the leaving tokens in different slot orders: put each head's in position order.
        order = np.argsort(leaving.positions, axis=2, kind="stable")  # (L, Hkv, M)
        sorted_leaving = LeavingTokens(
            positions=np.take_along_axis(leaving.positions, order, axis=2),
            key=np.take_along_axis(leaving.key, order[..., None], axis=2),
            value=np.take_along_axis(leaving.value, order[..., None], axis=2),
            statistics={name: np.take_along_axis(stat, order, axis=2) for name, stat in leaving.statistics.items()},
        )
        scores = self._consume(state, sorted_leaving)  # (L, Hkv, M) in position order
        unsorted = np.empty_like(scores)
        np.put_along_axis(unsorted, order, scores, axis=2)
        return unsorted

    def scored_in_pieces(self, state: ScorerState) -> bool:
        return state.staged is not None

    def scores_decode_batch(self, state: ScorerState) -> bool:
        # Reads no attention, and holds no tokens back (a prefill's last chunk may leave some).
        return not self.statistics and state.pending_key.shape[2] == 0

    def score_decode_batch(self, states, new_key, new_value, leaving_key, leaving_value) -> np.ndarray:
        if not self.runtime.spec.state_shapes:  # stateless: the B leaving tokens are one call's B rows
            rows = [array.transpose(1, 2, 0, 3) for array in (new_key, new_value, leaving_key, leaving_value)]
            scores, _ = self.runtime.step({}, *rows)  # (L, Hkv, B)
            return scores.transpose(2, 0, 1)
        if self.runtime.decode_session is not None:
            scores, recurrents = self.runtime.step_decode_batch(
                [state.recurrent for state in states], (new_key, new_value, leaving_key, leaving_value)
            )
            for state, recurrent in zip(states, recurrents):
                state.recurrent = recurrent
            return scores
        scores = np.empty(new_key.shape[:3], np.float32)  # (B, L, Hkv)
        for row, state in enumerate(states):  # the rows of one step: new token t, its leaving token
            score, state.recurrent = self.runtime.step(
                state.recurrent, new_key[row, :, :, None], new_value[row, :, :, None],
                leaving_key[row, :, :, None], leaving_value[row, :, :, None],
            )
            scores[row] = score[:, :, 0]
        return scores

    def _consume(self, state: ScorerState, leaving: LeavingTokens | None) -> np.ndarray:
        """Run the pending tokens through the memory; the M leaving tokens go to the last M rows."""
        pending = state.pending_key.shape[2]
        count = 0 if leaving is None else leaving.key.shape[2]
        if count == 0 and not state.recurrent:  # stateless and nothing to score: nothing to do
            state.pending_key, state.pending_value = state.pending_key[:, :, :0], state.pending_value[:, :, :0]
            return np.zeros((*state.pending_key.shape[:2], 0), np.float32)
        if count > pending:
            raise ValueError(f"{count} tokens leave but only {pending} arrived: observe must precede score")
        shape = state.pending_key.shape
        rows_key, rows_value = np.zeros(shape, np.float32), np.zeros(shape, np.float32)
        rows_attention = np.zeros(shape[:3], np.float32)
        if count:
            rows = slice(pending - count, pending)
            rows_key[:, :, rows], rows_value[:, :, rows] = leaving.key, leaving.value
            if self.statistics:
                rows_attention[:, :, rows] = np.log(np.maximum(leaving.statistics[self.ATTENTION], 1e-30))
        scores, state.recurrent = self.runtime.step(
            state.recurrent, state.pending_key, state.pending_value, rows_key, rows_value, rows_attention
        )
        state.pending_key, state.pending_value = state.pending_key[:, :, :0], state.pending_value[:, :, :0]
        return scores[:, :, pending - count :]
