"""Future-attention importance: what the scorer learns to predict.

For token t with protected window w, the target is the mean attention t receives from the queries at
positions d >= t + w (the ones that come after t left the window, i.e. the ones eviction affects),
max over the query heads sharing t's KV head (a slot is shared by its GQA group, so it matters if any
of them needs it), in log space (attention spans orders of magnitude; the ranking is what matters).

Computed blockwise over queries: each block's softmax rows are exact (a row needs only its own
keys), and the block adds its future-attention mass to a running per-token sum. Peak memory is
Hq * block * S, never S * S, so 32k-token traces of real models fit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

LOG_FLOOR = math.log(1e-30)  # log target of a token no future query attends to at all
BLOCK_ELEMENTS = 1 << 25  # default block: Hq * block * S <= 32M probabilities (128 MiB; ~6x in temporaries)


def future_importance(mean: torch.Tensor) -> torch.Tensor:
    """The target from per-query-head mean future attention: max over the group, in log space.
    (..., Hkv, G, N) -> (..., Hkv, N). Means of several continuations of one context may be combined first (traces take their max)."""
    return torch.log(mean.amax(dim=-2)).clamp_min(LOG_FLOOR)


TARGET_SCOPES = ("head", "layer", "model")


def value_weighted(target: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """The target times the token's value norm, in log space: (L, Hkv, N) + log |v| of (L, Hkv, S, D), N <= S.

    Attention alone overrates tokens that heads use as secondary sinks (" the", " in", newlines): they
    collect attention but their small values add little to the output (Guo et al. 2024, "Attention Score
    is not All You Need for Token Importance Indicator in KV Cache Reduction: Value Also Matters").
    Attention times |v| bounds what a token contributes to its head's output."""
    norm = value[:, :, : target.shape[-1]].float().norm(dim=-1).clamp_min(1e-6)  # (L, Hkv, N)
    return (target + norm.log()).clamp_min(LOG_FLOOR)


def shape_target(target: torch.Tensor, span: int = 0, scope: str = "head") -> torch.Tensor:
    """Training-time variants of the target, for (L, Hkv, N) log importances.

    span: a token is worth at least what the next `span` tokens are worth (forward max), so the words that
    lead up to a needed token (a key's name before its value) are kept with it. The scorer can learn this:
    a token is scored when it leaves the window, after it has seen the w tokens that follow it.
    scope: share the target across the KV heads of a layer ("layer") or all caches ("model") by max, so
    every head learns to keep what any head reads later, not only what it reads itself.
    """
    if scope not in TARGET_SCOPES:
        raise ValueError(f"unknown target scope {scope!r}; expected one of {TARGET_SCOPES}")
    shaped = target
    if span > 0:
        # forward max over [t, t + span]: pad the end with the floor, then a sliding max  (L, Hkv, N)
        padded = torch.nn.functional.pad(shaped, (0, span), value=LOG_FLOOR)
        shaped = padded.unfold(-1, span + 1, 1).amax(dim=-1)
    if scope == "layer":
        shaped = shaped.amax(dim=1, keepdim=True).expand_as(shaped)
    elif scope == "model":
        shaped = shaped.amax(dim=(0, 1), keepdim=True).expand_as(shaped)
    return shaped.contiguous()


@dataclass
class AttentionReceived:
    """What each token that leaves the window within a trace received, per KV head (log space)."""

    future_mean: torch.Tensor  # (Hkv, G, S - w) mean attention from queries d >= t + w, per query head
    window: torch.Tensor  # (Hkv, S - w) what is known when t leaves: the attention from queries
    # d in [t, t + w], each times the d + 1 keys it saw (relative to uniform, so it reads the same in a
    # budget-sized cache), summed over them and the group. A scorer input and a baseline.

    @property
    def future(self) -> torch.Tensor:
        """(Hkv, S - w) the target: mean over queries d >= t + w, max over the group, log."""
        return future_importance(self.future_mean)


@dataclass
class AttentionSums:
    """Attention summed per key over the queries of one forward (linear space, before any normalising),
    so that several forwards over one sequence (a context, then a continuation on its cache) add up."""

    future: torch.Tensor  # (..., Hkv, G, S) attention from counted queries d >= t + w, d >= first_query
    in_window: torch.Tensor  # (..., Hkv, G, S) relative attention from queries d in [t, t + w]

    def received(self, window: int, first_query: int = 0, length: int | None = None) -> AttentionReceived:
        """Normalise into targets for the tokens of a `length`-token sequence (default: every key here)
        that leave the window: the future mean counts queries d in [max(t + w, first_query), length)."""
        length = self.future.shape[-1] if length is None else length
        scored = max(length - window, 0)
        token = torch.arange(scored, device=self.future.device)
        count = (length - torch.clamp_min(token + window, first_query)).clamp_min(1).float()
        return AttentionReceived(
            future_mean=self.future[..., :scored] / count,  # (..., Hkv, G, S - w)
            window=torch.log(self.in_window[..., :scored].sum(dim=-2)).clamp_min(LOG_FLOOR),
        )


def attention_sums(
    query: torch.Tensor,  # (Hq, Sq, D), RoPE applied: the LAST Sq positions of the sequence
    key: torch.Tensor,  # (Hkv, S, D), RoPE applied: every key so far (a cache's and the new ones)
    window: int,
    scaling: float | None = None,
    block_size: int | None = None,
    first_query: int = 0,
) -> AttentionSums:
    """Per-key sums of what the queries give (see AttentionReceived). The queries sit at absolute
    positions S - Sq .. S - 1, so a forward over a cached context passes only its new queries."""
    query_heads, queries, dim = query.shape
    kv_heads, length = key.shape[:2]
    offset = length - queries  # absolute position of the first query
    group = query_heads // kv_heads
    scaling = dim**-0.5 if scaling is None else scaling
    if offset == 0 and first_query >= length:
        return _window_sums(query, key, window, scaling)
    block_size = block_size or max(16, BLOCK_ELEMENTS // (query_heads * length))
    grouped = query.float().reshape(kv_heads, group, queries, dim)  # (Hkv, G, Sq, D)
    key = key.float()
    future = query.new_zeros(kv_heads, group, length, dtype=torch.float32)  # (Hkv, G, S) summed attention
    in_window = query.new_zeros(kv_heads, group, length, dtype=torch.float32)
    token = torch.arange(length, device=query.device)
    for begin in range(0, queries, block_size):
        end = min(begin + block_size, queries)
        rows = token[offset + begin : offset + end, None]  # (b, 1) absolute query positions
        visible = offset + end  # keys any query of the block can see
        logits = grouped[:, :, begin:end] @ key[:, None, :visible].transpose(2, 3) * scaling  # (Hkv, G, b, visible)
        logits = logits.masked_fill(token[None, :visible] > rows, float("-inf"))  # causal
        probs = torch.softmax(logits, dim=-1)
        after = (token[None, :visible] <= rows - window) & (rows >= first_query)  # (b, visible): d >= t + w, d >= first
        future[:, :, :visible] += (probs * after).sum(dim=2)
        relative = probs * (rows + 1)  # d + 1 keys visible to query d
        in_window[:, :, :visible] += (relative * (token[None, :visible] >= rows - window)).sum(dim=2)
    return AttentionSums(future, in_window)


def _window_sums(query: torch.Tensor, key: torch.Tensor, window: int, scaling: float, rows_per_block: int = 512) -> AttentionSums:
    """attention_sums when no query counts toward the target (a context before its continuations):
    only the in-window band [d - w, d] of each row is needed, and the row's normaliser (its
    log-sum-exp) comes from a fused attention kernel, so the S x S matrix is never materialised
    (measured on SmolLM2 at 2k tokens: 0.8 s per layer dense, a few ms banded)."""
    query_heads, length, dim = query.shape
    kv_heads = key.shape[0]
    group = query_heads // kv_heads
    expanded = key.float().repeat_interleave(group, dim=0)[None]  # (1, Hq, S, D)
    _, logsumexp = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query.float()[None], expanded, expanded, 0.0, True, scale=scaling
    )
    logsumexp = logsumexp[0].reshape(kv_heads, group, length)  # (Hkv, G, S) per query row
    grouped = query.float().reshape(kv_heads, group, length, dim)
    key = key.float()
    in_window = query.new_zeros(kv_heads, group, length, dtype=torch.float32)
    lag = torch.arange(window + 1, device=query.device)
    for begin in range(0, length, rows_per_block):
        rows = torch.arange(begin, min(begin + rows_per_block, length), device=query.device)  # (b,) query d
        index = rows[:, None] - lag[None, :]  # (b, w + 1) keys d, d - 1, ..., d - w
        valid = index >= 0
        band = key[:, index.clamp_min(0)]  # (Hkv, b, w + 1, D)
        logits = torch.einsum("kgbd,kbjd->kgbj", grouped[:, :, rows], band) * scaling
        relative = torch.exp(logits - logsumexp[:, :, rows, None]) * valid * (rows[:, None] + 1).float()
        flat = index.clamp_min(0).reshape(-1).expand(kv_heads, group, -1)  # (Hkv, G, b * (w + 1))
        in_window.scatter_add_(2, flat, relative.reshape(kv_heads, group, -1))
    return AttentionSums(torch.zeros_like(in_window), in_window)


def attention_received(
    query: torch.Tensor,  # (Hq, S, D), RoPE applied
    key: torch.Tensor,  # (Hkv, S, D), RoPE applied
    window: int,
    scaling: float | None = None,
    block_size: int | None = None,
    first_query: int = 0,
) -> AttentionReceived:
    """Future-attention targets (and the in-window baseline) of the tokens that leave the window.

    Tokens t > S - 1 - w never leave the window within the trace and get none. `block_size` queries
    are processed at a time (default: as many as fit in BLOCK_ELEMENTS). Only queries d >= first_query
    count toward the target: in a task trace those are the question and its chain of thought, the
    tokens whose prediction eviction must not change; what filler queries attend to does not matter.
    """
    sums = attention_sums(query, key, window, scaling, block_size, first_query)
    return sums.received(window, first_query)


def dense_attention_received(
    query: torch.Tensor, key: torch.Tensor, window: int, scaling: float | None = None, first_query: int = 0
):
    """The same quantities from the full S x S attention matrix (reference for tests, small inputs only)."""
    query_heads, length, dim = query.shape
    kv_heads = key.shape[0]
    scaling = dim**-0.5 if scaling is None else scaling
    expanded = key.float().repeat_interleave(query_heads // kv_heads, dim=0)  # (Hq, S, D)
    logits = query.float() @ expanded.transpose(1, 2) * scaling  # (Hq, S, S) [query, token]
    token = torch.arange(length)
    logits = logits.masked_fill(token[None, :] > token[:, None], float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    query_position, token_position = token[:, None], token[None, :]  # (S, 1), (1, S)
    future = (query_position >= token_position + window) & (query_position >= first_query)  # (S, S) [query, token]
    in_window = (query_position >= token_position) & (query_position <= token_position + window)
    means = torch.stack(
        [probs[:, future[:, t], t].sum(dim=1) / max(int(future[:, t].sum()), 1) for t in range(length - window)], dim=1
    )
    sums = (probs * (query_position + 1) * in_window).sum(dim=1)[:, : length - window]  # (Hq, S - w)
    group = query_heads // kv_heads
    return AttentionReceived(
        future_mean=means.reshape(kv_heads, group, -1),
        window=torch.log(sums.reshape(kv_heads, group, -1).sum(dim=1)).clamp_min(LOG_FLOOR),
    )
