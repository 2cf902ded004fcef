"""The KVpop scorer: a small network per (layer, KV head) that scores a token when it leaves the window.

Two variants share everything but the memory:
  - "mlstm": a matrix memory in the style of the xLSTM mLSTM cell, updated with every new (key, value)
    of its head and read by a query projected from the leaving token. Because the token is scored
    w tokens after it entered, the memory has seen its "future" (what the model wrote after it).
  - "mlp": a stateless two-layer MLP over the leaving token's [key; value] (the comparison).

Inputs are what the slot cache holds: keys AFTER RoPE and values. The features add the norm of each
RoPE rotation pair of the key, which RoPE leaves unchanged, so content is visible without having to
undo the position-dependent rotation of the raw key coordinates.

Optionally (`attention_feature`), the leaving token's score also sees the attention it received
while in the window, relative to uniform (each query's probability times the number of keys it saw):
the policy observes it for free from the decoder step, and it is the heavy-hitter signal the
attention-based baselines rank by alone; the network learns when to trust it over content.

One code path runs every chunk length: training runs the chunkwise-parallel form over whole traces
(chunk by chunk, carrying the state), the runtime runs the same function on the tokens of one decoder
step, so the exported step and the trained network cannot drift apart.

Shapes: L layers, Hkv KV heads, H = L * Hkv scorer heads, T tokens, D head dim, F feature dim,
M memory dim (key/query and value width of the matrix memory), N hidden width of the score MLP.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
from torch import nn
from torch.nn import functional

from kvpop.policies.kvpop.text_spans import check_span_pooling
from kvpop.policies.kvpop.kinds import LEARNED_SCORER_KINDS

KINDS = LEARNED_SCORER_KINDS
STATE_NAMES = ("memory", "normaliser", "stabiliser")  # the mLSTM state, in this order everywhere
_MASKED = -1e30  # log-weight of a (query, key) pair the causal mask removes; exp() of it is 0


@dataclass(frozen=True)
class ScorerConfig:
    kind: str = "mlstm"  # "mlstm" (stateful) or "mlp" (stateless)
    num_layers: int = 2  # L of the base model
    num_kv_heads: int = 2  # Hkv of the base model: one independent scorer per (layer, KV head)
    head_dim: int = 64  # D of the base model
    window: int = 64  # w: the protected window the scorer was trained for (a token is scored w steps late)
    memory_dim: int = 16  # M: width of the matrix memory (mlstm only)
    hidden_dim: int = 32  # N: hidden width of the score MLP
    input_gate_cap: float = 15.0  # soft cap on the exponential input gate's log, for fp32 safety
    forget_bias: float = 3.0  # initial forget-gate bias: sigmoid(3) = 0.95, a memory of ~20 tokens
    attention_feature: bool = False  # also score from the leaving token's (log, relative) in-window attention
    # Trained on one model-wide target (train --target-scope model): every head's network estimates the same
    # importance, so serving averages a token's L * Hkv scores and every cache keeps the same tokens.
    shared_ranking: bool = False
    # "line": serving ranks a prompt token by the mean score of its line (kvpop.policies.kvpop.text_spans);
    # "line_contrast": by that mean minus the mean score of the text around the line. Chosen on the
    # validation split (docs/QUALITY.md); only with the shared ranking.
    span_pooling: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"scorer kind must be one of {KINDS}, got {self.kind!r}")
        check_span_pooling(self.span_pooling, self.shared_ranking)
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even (RoPE pairs), got {self.head_dim}")
        for name in ("num_layers", "num_kv_heads", "window", "memory_dim", "hidden_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def num_heads(self) -> int:
        return self.num_layers * self.num_kv_heads

    @property
    def feature_dim(self) -> int:
        return 2 * self.head_dim + self.head_dim // 2  # [key; value; key RoPE-pair norms]

    @property
    def stateful(self) -> bool:
        return self.kind == "mlstm"

    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        """Per-sequence recurrent state, by name (empty for the stateless variant)."""
        if not self.stateful:
            return {}
        heads, memory = (self.num_layers, self.num_kv_heads), self.memory_dim
        return {"memory": (*heads, memory, memory), "normaliser": (*heads, memory), "stabiliser": heads}

    def to_dict(self) -> dict:
        return asdict(self)


class HeadLinear(nn.Module):
    """H independent linear maps applied as one batched matmul: (H, T, in) -> (H, T, out).

    A matmul over the H heads, not an einsum: onnxruntime's CPU Einsum ran "hti,hio->hto"-style
    products as many tiny ones (4.7 of 7.6 ms for 16 SmolLM2 sequences in a batch graph)."""

    def __init__(self, heads: int, in_features: int, out_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(heads, in_features, out_features) / math.sqrt(in_features))
        self.bias = nn.Parameter(torch.zeros(heads, 1, out_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.matmul(x, self.weight) + self.bias  # (H, T, in) @ (H, in, out) -> (H, T, out)


def mlstm_chunk(
    query: torch.Tensor,  # (H, T, M): read query of the token leaving at each step
    key: torch.Tensor,  # (H, T, M): memory key of the token entering at each step
    value: torch.Tensor,  # (H, T, M)
    log_input: torch.Tensor,  # (H, T) log of the exponential input gate
    log_forget: torch.Tensor,  # (H, T) log of the sigmoid forget gate
    memory: torch.Tensor,  # (H, M, M) stabilised matrix memory before the chunk
    normaliser: torch.Tensor,  # (H, M) stabilised normaliser state
    stabiliser: torch.Tensor,  # (H,) log scale m of the two: the true memory is exp(m) * memory
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Update the memory with T tokens and read it after each one; returns (read (H, T, M), state).

    Step t reads h_t = C_t q_t / max(|n_t . q_t|, 1) with C_t = f_t C_{t-1} + i_t v_t k_t^T and
    n_t = f_t n_{t-1} + i_t k_t (xLSTM, Beck et al. 2024). Everything is kept relative to a running
    log scale m so the exponential input gate never overflows; h does not depend on m's value.
    """
    steps = query.shape[1]
    decay = torch.cumsum(log_forget, dim=1)  # (H, T) log decay from the chunk start to t
    position = torch.arange(steps, device=query.device)
    causal = position[:, None] >= position[None, :]  # (T, T) step t reads tokens s <= t
    # Log weight of token s in the memory read at step t, and of the carried state.
    log_weight = decay[:, :, None] - decay[:, None, :] + log_input[:, None, :]  # (H, T, T)
    log_weight = torch.where(causal, log_weight, torch.full_like(log_weight, _MASKED))
    log_carry = decay + stabiliser[:, None]  # (H, T)
    # The scale cancels between numerator and denominator, so it needs no gradient.
    row_scale = torch.maximum(log_carry, log_weight.amax(dim=-1)).detach()  # (H, T)
    weight = torch.exp(log_weight - row_scale[..., None]) * (query @ key.transpose(1, 2))  # (H, T, T)
    carry = torch.exp(log_carry - row_scale)  # (H, T)
    numerator = carry[..., None] * (query @ memory) + weight @ value  # (H, T, M)
    denominator = carry * (query * normaliser[:, None]).sum(-1) + weight.sum(-1)  # (H, T)
    read = numerator / torch.maximum(denominator.abs(), torch.exp(-row_scale))[..., None]

    # State after the chunk's last token: the last row of the same weights, without the query.
    last_log_weight, last_log_carry = log_weight[:, -1], log_carry[:, -1]  # (H, T), (H,)
    new_stabiliser = torch.maximum(last_log_carry, last_log_weight.amax(dim=-1)).detach()  # (H,)
    last_weight = torch.exp(last_log_weight - new_stabiliser[:, None])  # (H, T)
    last_carry = torch.exp(last_log_carry - new_stabiliser)  # (H,)
    weighted_key = key * last_weight[..., None]  # (H, T, K); products, not einsums (see HeadLinear)
    new_memory = last_carry[:, None, None] * memory + weighted_key.transpose(1, 2) @ value  # (H, K, V)
    new_normaliser = last_carry[:, None] * normaliser + weighted_key.sum(dim=1)  # (H, K)
    return read, new_memory, new_normaliser, new_stabiliser


def mlstm_step(
    query: torch.Tensor,  # (..., M): read query of the token leaving now
    key: torch.Tensor,  # (..., M): memory key of the token entering now
    value: torch.Tensor,  # (..., M)
    log_input: torch.Tensor,  # (...) log of the exponential input gate
    log_forget: torch.Tensor,  # (...) log of the sigmoid forget gate
    memory: torch.Tensor,  # (..., M, M) stabilised matrix memory
    normaliser: torch.Tensor,  # (..., M)
    stabiliser: torch.Tensor,  # (...) log scale m
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`mlstm_chunk` for one token, in the recurrent form: the same numbers with a fraction of the
    operations (the decode graph runs it every step). Any leading dims: heads, or heads x sequences.

    The new state first (C = f C + i k v^T, n = f n + i k, kept relative to m' = max(log f + m, log i)),
    then the read from it: C q / max(|n . q|, exp(-m')), which is the chunk form's row for T = 1."""
    log_carry = log_forget + stabiliser  # (...)
    new_stabiliser = torch.maximum(log_carry, log_input)
    carry = torch.exp(log_carry - new_stabiliser)[..., None]  # (..., 1)
    write = torch.exp(log_input - new_stabiliser)[..., None]
    new_memory = carry[..., None] * memory + (write * key)[..., :, None] * value[..., None, :]  # (..., K, V)
    new_normaliser = carry * normaliser + write * key  # (..., K)
    numerator = torch.matmul(query[..., None, :], new_memory)[..., 0, :]  # (..., V)
    denominator = (query * new_normaliser).sum(-1, keepdim=True)  # (..., 1)
    read = numerator / torch.maximum(denominator.abs(), torch.exp(-new_stabiliser)[..., None])
    return read, new_memory, new_normaliser, new_stabiliser


class Scorer(nn.Module):
    """forward(new K/V, leaving K/V, state) -> (score of each leaving token, new state).

    Row t of the leaving tensors is the token that leaves the window when new token t arrives; its
    score is read after the memory has taken in new token t. Higher score = more worth keeping.
    """

    def __init__(self, config: ScorerConfig) -> None:
        super().__init__()
        self.config = config
        heads, features = config.num_heads, config.feature_dim
        # Standardisation of the features, per head, fitted on traces before training.
        self.register_buffer("feature_mean", torch.zeros(heads, 1, features))
        self.register_buffer("feature_std", torch.ones(heads, 1, features))
        self.register_buffer("attention_mean", torch.zeros(heads, 1, 1))
        self.register_buffer("attention_std", torch.ones(heads, 1, 1))
        head_input = features + int(config.attention_feature)
        if config.stateful:
            memory = config.memory_dim
            self.write = HeadLinear(heads, features, 2 * memory + 2)  # key, value, input gate, forget gate
            self.read = HeadLinear(heads, features, memory)  # query from the leaving token
            with torch.no_grad():
                self.write.bias[..., -1] = config.forget_bias
            head_input += memory
        self.hidden = HeadLinear(heads, head_input, config.hidden_dim)
        self.output = HeadLinear(heads, config.hidden_dim, 1)

    # -- features -------------------------------------------------------------------------------

    def features(self, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """(L, Hkv, T, D) keys (RoPE applied) and values -> (H, T, F) standardised features."""
        layers, kv_heads, steps, dim = key.shape
        half = dim // 2
        # Llama-family RoPE rotates coordinate i with i + D/2; the pair's norm is position-free.
        pair_norm = torch.sqrt(key[..., :half] ** 2 + key[..., half:] ** 2 + 1e-12)  # (L, Hkv, T, D/2)
        x = torch.cat([key, value, pair_norm], dim=-1).float().reshape(layers * kv_heads, steps, -1)
        return (x - self.feature_mean) / self.feature_std

    def leaving_features(self, key: torch.Tensor, value: torch.Tensor, attention: torch.Tensor | None) -> torch.Tensor:
        """Features of the leaving tokens: (H, T, F), plus the standardised (L, Hkv, T) log attention."""
        x = self.features(key, value)
        if not self.config.attention_feature:
            return x
        attention = attention.float().reshape(x.shape[0], -1, 1)
        return torch.cat([x, (attention - self.attention_mean) / self.attention_std], dim=-1)

    @torch.no_grad()
    def fit_standardisation(self, key: torch.Tensor, value: torch.Tensor, attention: torch.Tensor) -> None:
        """Per-head feature mean and std from sample keys, values (L, Hkv, T, D) and log attention (L, Hkv, T')."""
        self.feature_mean.zero_()
        self.feature_std.fill_(1.0)
        x = self.features(key, value)  # (H, T, F)
        self.feature_mean.copy_(x.mean(dim=1, keepdim=True))
        self.feature_std.copy_(x.std(dim=1, keepdim=True).clamp_min(1e-4))
        attention = attention.float().reshape(x.shape[0], -1, 1)
        self.attention_mean.copy_(attention.mean(dim=1, keepdim=True))
        self.attention_std.copy_(attention.std(dim=1, keepdim=True).clamp_min(1e-4))

    # -- state ----------------------------------------------------------------------------------

    def initial_state(self) -> tuple[torch.Tensor, ...]:
        """Zero state per sequence, (L, Hkv, ...) tensors named by STATE_NAMES (empty when stateless)."""
        device = self.feature_mean.device
        return tuple(torch.zeros(shape, device=device) for shape in self.config.state_shapes().values())

    # -- forward --------------------------------------------------------------------------------

    def forward(
        self,
        new_key: torch.Tensor,  # (L, Hkv, T, D), RoPE applied
        new_value: torch.Tensor,  # (L, Hkv, T, D)
        leaving_key: torch.Tensor,  # (L, Hkv, T, D): the token leaving the window at each step
        leaving_value: torch.Tensor,  # (L, Hkv, T, D)
        state: tuple[torch.Tensor, ...] = (),  # STATE_NAMES tensors (L, Hkv, ...), () when stateless
        leaving_attention: torch.Tensor | None = None,  # (L, Hkv, T) log relative in-window attention
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        layers, kv_heads, steps, _ = leaving_key.shape
        heads = layers * kv_heads
        leaving = self.leaving_features(leaving_key, leaving_value, leaving_attention)  # (H, T, F [+ 1])
        if self.config.stateful:
            memory_dim = self.config.memory_dim
            written = self.write(self.features(new_key, new_value))  # (H, T, 2M + 2)
            key, value = written[..., :memory_dim], written[..., memory_dim : 2 * memory_dim]
            cap = self.config.input_gate_cap
            log_input = cap * torch.tanh(written[..., -2] / cap)  # (H, T)
            log_forget = functional.logsigmoid(written[..., -1])  # (H, T)
            query = self.read(leaving[..., : self.config.feature_dim]) / math.sqrt(memory_dim)  # (H, T, M)
            memory, normaliser, stabiliser = (s.reshape(heads, *s.shape[2:]) for s in state)
            read, memory, normaliser, stabiliser = mlstm_chunk(
                query, key, value, log_input, log_forget, memory, normaliser, stabiliser
            )
            leaving = torch.cat([leaving, read], dim=-1)  # (H, T, F [+ 1] + M)
            state = tuple(s.reshape(layers, kv_heads, *s.shape[1:]) for s in (memory, normaliser, stabiliser))
        score = self.output(functional.gelu(self.hidden(leaving)))  # (H, T, 1)
        return score.reshape(layers, kv_heads, steps), state

    def score_sequence(
        self,
        key: torch.Tensor,  # (L, Hkv, S, D)
        value: torch.Tensor,  # (L, Hkv, S, D)
        window_attention: torch.Tensor | None = None,  # (L, Hkv, S - w), needed with attention_feature
        chunk_size: int = 64,
    ) -> torch.Tensor:
        """Scores of a whole trace, as the policy would see them: (L, Hkv, S - w).

        Entry u is token u's score when it leaves the window, at step u + w. Runs chunk by chunk,
        carrying the state, so memory grows with S * chunk_size.
        """
        window, length = self.config.window, key.shape[2]
        if length <= window:
            return key.new_zeros(*key.shape[:2], 0)
        pad = key.new_zeros(*key.shape[:2], window, key.shape[-1])
        leaving_key = torch.cat([pad, key[:, :, : length - window]], dim=2)  # row t: token t - w
        leaving_value = torch.cat([pad, value[:, :, : length - window]], dim=2)
        leaving_attention = None
        if self.config.attention_feature:
            leaving_attention = torch.cat([pad[..., 0], window_attention], dim=2)
        state, scores = self.initial_state(), []
        # The first w steps have no leaving token; the stateless variant may skip them entirely.
        start = 0 if self.config.stateful else window
        for begin in range(start, length, chunk_size):
            rows = slice(begin, min(begin + chunk_size, length))
            inputs = (tensor[:, :, rows] for tensor in (key, value, leaving_key, leaving_value))
            attention = None if leaving_attention is None else leaving_attention[:, :, rows]
            score, state = self(*inputs, state, attention)
            scores.append(score)
        return torch.cat(scores, dim=2)[:, :, window - start :]


def save_scorer(scorer: Scorer, path, extra: dict | None = None) -> None:
    torch.save({"config": scorer.config.to_dict(), "state_dict": scorer.state_dict(), **(extra or {})}, path)


def load_scorer(path) -> Scorer:
    checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    scorer = Scorer(ScorerConfig(**checkpoint["config"]))
    scorer.load_state_dict(checkpoint["state_dict"])
    return scorer.eval()
