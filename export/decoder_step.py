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


def rotate_half_matrix(head_dim: int) -> torch.Tensor:
    """R (D, D) with x @ R == cat(-x[..., D/2:], x[..., :D/2]), RoPE's rotate_half, exactly (one +-1
    per column). Why a product: traced, the halves' slices cost a dozen shape and copy nodes a layer;
    the product is one small MatMul."""
    half = head_dim // 2
    rotation = torch.zeros(head_dim, head_dim)
    rotation[half:, :half] = -torch.eye(half)
    rotation[:half, half:] = torch.eye(half)
    return rotation


class SlotCacheDecoderStep(nn.Module):
    """forward(input_ids, position_ids, past_key, past_value, slot_mask) -> logits, new K/V, attention.

    Shapes: B sequences, T new tokens, S cache slots (may be 0), L layers, Hq query heads,
    Hkv key/value heads, D head dim, V vocabulary. The caches are (L, B, Hkv, S, D) tensors or, as
    exported, tuples of L (B, Hkv, S, D) tensors (one graph input per layer: kvpop.decoder).
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
        rotation = rotate_half_matrix(self.head_dim).to(causal_lm.lm_head.weight.dtype)
        self.register_buffer("rotation", rotation, persistent=False)

    def forward(
        self,
        input_ids: torch.Tensor,  # (B, T) int64
        position_ids: torch.Tensor,  # (B, T) int64
        past_key: torch.Tensor | tuple[torch.Tensor, ...],  # (L, B, Hkv, S, D) or L x (B, Hkv, S, D), RoPE applied
        past_value: torch.Tensor | tuple[torch.Tensor, ...],  # (L, B, Hkv, S, D) or L x (B, Hkv, S, D)
        slot_mask: torch.Tensor,  # (B, S) bool, True where a slot holds a token
    ):
        [(hidden, new_key, new_value, attention, chunk_attention)] = self.run_segments(
            [(input_ids, position_ids, past_key, past_value, slot_mask)]
        )
        logits = self.lm_head(self.decoder.norm(hidden))  # (B, T, V)
        return logits, new_key, new_value, attention, chunk_attention

    def run_segments(self, segments: list[tuple[torch.Tensor, ...]]) -> list[tuple[torch.Tensor, ...]]:
        """The decoder layers over several segments at once, each (input_ids, position_ids, past_key,
        past_value, slot_mask) as `forward` takes them, with its own B_i, T_i and S_i. Every segment's
        tokens go through the projections and the MLP as one (N, hidden) matrix, N = sum B_i * T_i, so
        the weights are read once for all of them; attention stays within each segment's own cache.
        -> per segment: hidden (B, T, hidden) before the final norm, new_key, new_value (L, B, Hkv, T, D),
        attention (L, B, Hq, T, S), chunk_attention (L, B, Hq, T, T)."""
        shapes = [input_ids.shape for input_ids, *_ in segments]  # (B_i, T_i)
        hiddens = [self.decoder.embed_tokens(input_ids) for input_ids, *_ in segments]  # (B, T, hidden) each
        hidden_size = hiddens[0].shape[-1]
        rotary = []
        for hidden, (_, position_ids, *_) in zip(hiddens, segments):
            cos, sin = self.decoder.rotary_emb(hidden, position_ids)  # (B, T, D) each
            rotary.append((cos[:, None], sin[:, None]))  # (B, 1, T, D)

        # Additive masks, shared by every layer and head, and each segment's slot count: computed once
        # here, not per layer. A new token always sees itself, so no softmax row is ever fully masked.
        minimum = torch.finfo(torch.float32).min
        masks = []
        for (batch, new_tokens), (input_ids, _, _, _, slot_mask) in zip(shapes, segments):
            past_bias = torch.where(slot_mask, 0.0, minimum)[:, None, None, :]  # (B, 1, 1, S)
            causal = torch.ones(new_tokens, new_tokens, dtype=torch.bool, device=input_ids.device).tril()
            chunk_bias = torch.where(causal, 0.0, minimum).repeat(self.group_size, 1)  # (G * T, T): rows as grouped below
            masks.append((past_bias, chunk_bias, slot_mask.shape[1]))

        flat = torch.cat([hidden.reshape(-1, hidden_size) for hidden in hiddens]) if len(segments) > 1 \
            else hiddens[0].reshape(-1, hidden_size)  # (N, hidden)
        ends = []  # each segment's rows of `flat` are [previous end, end)
        for batch, new_tokens in shapes:
            ends.append((ends[-1] if ends else 0) + batch * new_tokens)
        outputs = [([], [], [], []) for _ in segments]  # new keys, new values, attentions, chunk attentions
        for index, layer in enumerate(self.decoder.layers):
            attention = layer.self_attn
            normed = layer.input_layernorm(flat)
            queries, keys, values = attention.q_proj(normed), attention.k_proj(normed), attention.v_proj(normed)
            contexts = []
            for number, ((batch, new_tokens), segment, (cos, sin), bias) in enumerate(zip(shapes, segments, rotary, masks)):
                projected = (queries, keys, values)
                if len(segments) > 1:  # this segment's rows (one segment: all of them, no Slice traced)
                    rows = slice(ends[number - 1] if number else 0, ends[number])
                    projected = tuple(tensor[rows] for tensor in projected)
                context, key, value, probs_past, probs_new = self._attend(
                    index, attention, batch, new_tokens, *projected, segment, cos, sin, bias
                )
                contexts.append(context)  # (B * T, Hq * D)
                for collected, tensor in zip(outputs[number], (key, value, probs_past, probs_new)):
                    collected.append(tensor)
            context = torch.cat(contexts) if len(contexts) > 1 else contexts[0]  # (N, Hq * D)
            flat = flat + attention.o_proj(context)
            flat = flat + layer.mlp(layer.post_attention_layernorm(flat))

        results = []
        for number, ((batch, new_tokens), (new_keys, new_values, attentions, chunk_attentions)) in enumerate(zip(shapes, outputs)):
            rows = slice(ends[number - 1] if number else 0, ends[number])
            results.append((
                flat[rows].reshape(batch, new_tokens, hidden_size),
                torch.stack(new_keys),  # (L, B, Hkv, T, D)
                torch.stack(new_values),  # (L, B, Hkv, T, D)
                torch.stack(attentions),  # (L, B, Hq, T, S)
                torch.stack(chunk_attentions),  # (L, B, Hq, T, T)
            ))
        return results

    def _attend(self, index, attention, batch, new_tokens, query, key, value, segment, cos, sin, bias):
        """One layer's attention for one segment: its new tokens' queries over its cache and each other.
        -> context (B * T, Hq * D), key and value (B, Hkv, T, D), attention (B, Hq, T, S) and (B, Hq, T, T)."""
        _, _, past_key, past_value, _ = segment
        past_bias, chunk_bias, past_slots = bias
        heads, kv_heads, head_dim = self.num_attention_heads, self.num_kv_heads, self.head_dim
        # Head counts spelt out, never -1: an empty segment (B = 0) leaves nothing to infer it from.
        query = query.view(batch, new_tokens, heads, head_dim).transpose(1, 2)  # (B, Hq, T, D)
        key = key.view(batch, new_tokens, kv_heads, head_dim).transpose(1, 2)  # (B, Hkv, T, D)
        value = value.view(batch, new_tokens, kv_heads, head_dim).transpose(1, 2)
        if hasattr(attention, "q_norm"):  # Qwen3 normalises queries and keys per head
            query, key = attention.q_norm(query), attention.k_norm(key)
        query = query * cos + (query @ self.rotation) * sin
        key = key * cos + (key @ self.rotation) * sin

        # The G query heads sharing a KV head as G * T rows of it: (B, Hkv, G * T, D), so every product
        # below is a plain batched MatMul over the cache as it lies (no broadcast copy of it).
        grouped_query = query.reshape(batch, kv_heads, self.group_size * new_tokens, head_dim)
        scores_past = (grouped_query @ past_key[index].transpose(-1, -2)).float() * self.scaling + past_bias
        scores_new = (grouped_query @ key.transpose(-1, -2)).float() * self.scaling + chunk_bias
        probs = torch.softmax(torch.cat([scores_past, scores_new], dim=-1), dim=-1)  # (B, Hkv, G * T, S + T)
        probs_past, probs_new = probs[..., :past_slots], probs[..., past_slots:]
        context = probs_past.to(past_value[index].dtype) @ past_value[index] + probs_new.to(value.dtype) @ value
        context = context.reshape(batch, heads, new_tokens, head_dim).transpose(1, 2)  # (B, T, Hq, D)
        return (
            context.reshape(batch * new_tokens, heads * head_dim), key, value,
            # -1, not S: ONNX Reshape reads a 0 in the shape as "keep that dimension" (an empty cache would get T)
            probs_past.reshape(batch, heads, new_tokens, -1),
            probs_new.reshape(batch, heads, new_tokens, new_tokens),
        )


MIXED_SEGMENTS = ("decode", "prompt")
MIXED_OUTPUT_NAMES = [f"{segment}_{name}" for segment in MIXED_SEGMENTS for name in ("logits", "new_key", "new_value")]


class MixedDecoderStep(SlotCacheDecoderStep):
    """One call for a decode batch and prompt pieces of other sequences: vLLM's mixed batch.

    Why: on a device where a step's cost is mostly reading the weights, a prompt piece run in its own
    call beside a decode step pays for the weights twice; here the decode rows (T = 1) and the prompt
    rows (T tokens each) share the projections and the MLP, each segment attending to its own cache.
    Last-position logits and no attention outputs (the serving hot path, for policies that read no
    attention). Either segment may be empty (B = 0).

    forward(decode_input_ids (Bd, 1), decode_position_ids, decode_past_key (L, Bd, Hkv, Sd, D),
    decode_past_value, decode_slot_mask (Bd, Sd), prompt_input_ids (Bp, T), prompt_position_ids,
    prompt_past_key (L, Bp, Hkv, Sp, D), prompt_past_value, prompt_slot_mask (Bp, Sp))
    -> decode_logits (Bd, 1, V), decode_new_key, decode_new_value (L, Bd, Hkv, 1, D),
       prompt_logits (Bp, 1, V), prompt_new_key, prompt_new_value (L, Bp, Hkv, T, D)
    """

    def forward(  # type: ignore[override]
        self,
        decode_input_ids: torch.Tensor,  # (Bd, 1)
        decode_position_ids: torch.Tensor,  # (Bd, 1)
        decode_past_key: torch.Tensor,  # (L, Bd, Hkv, Sd, D)
        decode_past_value: torch.Tensor,
        decode_slot_mask: torch.Tensor,  # (Bd, Sd)
        prompt_input_ids: torch.Tensor,  # (Bp, T)
        prompt_position_ids: torch.Tensor,  # (Bp, T)
        prompt_past_key: torch.Tensor,  # (L, Bp, Hkv, Sp, D)
        prompt_past_value: torch.Tensor,
        prompt_slot_mask: torch.Tensor,  # (Bp, Sp)
    ):
        segments = [
            (decode_input_ids, decode_position_ids, decode_past_key, decode_past_value, decode_slot_mask),
            (prompt_input_ids, prompt_position_ids, prompt_past_key, prompt_past_value, prompt_slot_mask),
        ]
        (decode_hidden, decode_key, decode_value, _, _), (prompt_hidden, prompt_key, prompt_value, _, _) = self.run_segments(segments)
        # One lm_head product for both segments' last positions: (Bd + Bp, 1, V). (3-D, as in the step's
        # own export, so the exporter folds the same transposed weight and the two graphs share it.)
        logits = self.lm_head(self.decoder.norm(torch.cat([decode_hidden[:, -1:], prompt_hidden[:, -1:]])))
        decode_rows = decode_hidden.shape[0]
        return (
            logits[:decode_rows], decode_key, decode_value,  # (Bd, 1, V), (L, Bd, Hkv, 1, D) twice
            logits[decode_rows:], prompt_key, prompt_value,  # (Bp, 1, V), (L, Bp, Hkv, T, D) twice
        )
