"""A Hugging Face Llama-family decoder rewritten as one step over an explicit fixed-slot KV cache.

Why a rewrite instead of exporting the HF forward: the HF cache is an ordered, growing list of
tokens. KVpop needs a cache whose slots can be overwritten in any order, so the step takes the cached
keys/values plus a validity mask, returns the new tokens' keys (RoPE already applied) and values for
the caller to store, and returns the attention the new queries put on the cached slots (what the
eviction policies score with). Because keys are stored after RoPE, slot order never matters.

The module reuses the HF model's own submodules (embeddings, projections, norms, MLP, rotary
embedding), so weights are shared and any RoPE scaling the model configures is honoured.
"""

from __future__ import annotations

import torch
from torch import nn

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)

STEP_INPUT_NAMES = ["input_ids", "position_ids", "past_key", "past_value", "slot_mask"]
STEP_OUTPUT_NAMES = ["logits", "new_key", "new_value", "attention", "chunk_attention"]


class UnsupportedModelError(ValueError):
    pass


def check_supported(config) -> str:
    """Return the architecture name, or raise naming what is supported."""
    architectures = list(getattr(config, "architectures", None) or [])
    supported = [name for name in architectures if name in SUPPORTED_ARCHITECTURES]
    if not supported:
        raise UnsupportedModelError(
            f"unsupported architecture {architectures or config.model_type!r}: KVpop exports "
            f"decoder-only RoPE models of the Llama family: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return supported[0]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class SlotCacheDecoderStep(nn.Module):
    """forward(input_ids, position_ids, past_key, past_value, slot_mask) -> logits, new K/V, attention.

    Shapes: B sequences, T new tokens, S cache slots (may be 0), L layers, Hq query heads,
    Hkv key/value heads, D head dim, V vocabulary.
    """

    def __init__(self, causal_lm: nn.Module) -> None:
        super().__init__()
        config = causal_lm.config
        check_supported(config)
        self.decoder = causal_lm.model
        self.lm_head = causal_lm.lm_head
        self.num_attention_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.group_size = self.num_attention_heads // self.num_kv_heads
        self.scaling = self.head_dim**-0.5

    def forward(
        self,
        input_ids: torch.Tensor,  # (B, T) int64
        position_ids: torch.Tensor,  # (B, T) int64
        past_key: torch.Tensor,  # (L, B, Hkv, S, D), RoPE applied
        past_value: torch.Tensor,  # (L, B, Hkv, S, D)
        slot_mask: torch.Tensor,  # (B, S) bool, True where a slot holds a token
    ):
        batch, new_tokens = input_ids.shape
        hidden = self.decoder.embed_tokens(input_ids)  # (B, T, hidden)
        cos, sin = self.decoder.rotary_emb(hidden, position_ids)  # (B, T, D) each
        cos, sin = cos[:, None], sin[:, None]  # (B, 1, T, D)

        # Additive masks, shared by every layer and head. A new token always sees itself, so no
        # softmax row is ever fully masked.
        minimum = torch.finfo(torch.float32).min
        past_bias = torch.where(slot_mask, 0.0, minimum)[:, None, None, None, :]  # (B, 1, 1, 1, S)
        causal = torch.ones(new_tokens, new_tokens, dtype=torch.bool, device=input_ids.device).tril()
        chunk_bias = torch.where(causal, 0.0, minimum)  # (T, T)

        new_keys, new_values, attentions, chunk_attentions = [], [], [], []
        for index, layer in enumerate(self.decoder.layers):
            attention = layer.self_attn
            residual = hidden
            normed = layer.input_layernorm(hidden)
            query = attention.q_proj(normed).view(batch, new_tokens, -1, self.head_dim).transpose(1, 2)
            key = attention.k_proj(normed).view(batch, new_tokens, -1, self.head_dim).transpose(1, 2)
            value = attention.v_proj(normed).view(batch, new_tokens, -1, self.head_dim).transpose(1, 2)
            if hasattr(attention, "q_norm"):  # Qwen3 normalises queries and keys per head
                query, key = attention.q_norm(query), attention.k_norm(key)
            query = query * cos + rotate_half(query) * sin  # (B, Hq, T, D)
            key = key * cos + rotate_half(key) * sin  # (B, Hkv, T, D)

            # Group query heads by the KV head they share: (B, Hkv, G, T, D).
            grouped_query = query.view(batch, self.num_kv_heads, self.group_size, new_tokens, self.head_dim)
            past_k = past_key[index][:, :, None]  # (B, Hkv, 1, S, D)
            past_v = past_value[index][:, :, None]
            scores_past = (grouped_query @ past_k.transpose(-1, -2)).float() * self.scaling + past_bias
            scores_new = (grouped_query @ key[:, :, None].transpose(-1, -2)).float() * self.scaling + chunk_bias
            past_slots = scores_past.shape[-1]
            probs = torch.softmax(torch.cat([scores_past, scores_new], dim=-1), dim=-1)  # (B, Hkv, G, T, S+T)
            probs_past, probs_new = probs[..., :past_slots], probs[..., past_slots:]
            context = probs_past.to(past_v.dtype) @ past_v + probs_new.to(value.dtype) @ value[:, :, None]
            context = context.reshape(batch, self.num_attention_heads, new_tokens, self.head_dim)
            context = context.transpose(1, 2).reshape(batch, new_tokens, -1)
            hidden = residual + attention.o_proj(context)
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))

            new_keys.append(key)
            new_values.append(value)
            attentions.append(probs_past.reshape(batch, self.num_attention_heads, new_tokens, past_slots))
            chunk_attentions.append(probs_new.reshape(batch, self.num_attention_heads, new_tokens, new_tokens))

        logits = self.lm_head(self.decoder.norm(hidden))  # (B, T, V)
        return (
            logits,
            torch.stack(new_keys),  # (L, B, Hkv, T, D)
            torch.stack(new_values),  # (L, B, Hkv, T, D)
            torch.stack(attentions),  # (L, B, Hq, T, S)
            torch.stack(chunk_attentions),  # (L, B, Hq, T, T)
        )
