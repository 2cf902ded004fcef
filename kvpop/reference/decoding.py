"""Greedy decoding with the full KV cache or with StreamingLLM eviction.

StreamingLLM (Xiao et al., "Efficient Streaming Language Models with Attention Sinks", 2023)
keeps the first `sink_tokens` tokens and the most recent ones. Keys in the Hugging Face cache
are stored after RoPE, so dropping entries from the middle of the cache is valid as long as
new tokens get their true absolute positions: position ids are passed explicitly, and the
causal mask is sized from the (cropped) cache, which is passed explicitly.

The prompt is prefilled in chunks and the cache is cropped before every chunk so that no token
(prompt or generated) ever attends to more than `budget` cached tokens, itself included; a
one-shot full prefill would let the last prompt tokens read evicted facts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache, LlamaForCausalLM


@dataclass(frozen=True)
class StreamingLLM:
    budget: int  # cache slots per head: sinks + recent window
    sink_tokens: int = 4

    def __post_init__(self) -> None:
        if self.budget <= self.sink_tokens + 1:
            raise ValueError(f"budget {self.budget} must exceed sink_tokens + 1 = {self.sink_tokens + 1}")

    def crop(self, cache: DynamicCache, room: int) -> None:
        """Evict from the middle so that `room` new tokens fit in the budget."""
        keep = self.budget - room
        for layer in cache.layers:
            if not layer.is_initialized or layer.keys.shape[-2] <= keep:
                continue
            recent = keep - self.sink_tokens
            # keys/values: (batch, kv_heads, seq, head_dim); the sinks, then the most recent tokens
            layer.keys = torch.cat([layer.keys[..., : self.sink_tokens, :], layer.keys[..., -recent:, :]], dim=-2)
            layer.values = torch.cat([layer.values[..., : self.sink_tokens, :], layer.values[..., -recent:, :]], dim=-2)


@torch.no_grad()
def greedy_generate(
    model: LlamaForCausalLM,
    prompt_ids: list[int],
    max_new_tokens: int,
    stop_ids: set[int],
    final_id: int | None = None,
    policy: StreamingLLM | None = None,
    prefill_chunk: int = 16,
) -> list[int]:
    """Greedy continuation of prompt_ids (BOS included); policy None keeps the full cache.

    Stops at a token in stop_ids, or right after the token that follows `final_id` (the answer).
    """
    cache = DynamicCache(config=model.config)
    chunk = len(prompt_ids) if policy is None else max(1, min(prefill_chunk, policy.budget - policy.sink_tokens - 1))
    logits = None
    for start in range(0, len(prompt_ids), chunk):
        ids = prompt_ids[start : start + chunk]
        if policy is not None:
            policy.crop(cache, room=len(ids))
        logits = _forward(model, ids, start, cache)
    generated: list[int] = []
    position = len(prompt_ids)
    while len(generated) < max_new_tokens:
        token = int(logits[0, -1].argmax())
        generated.append(token)
        if token in stop_ids or (len(generated) >= 2 and generated[-2] == final_id):
            break
        if policy is not None:
            policy.crop(cache, room=1)
        logits = _forward(model, [token], position, cache)
        position += 1
    return generated


def _forward(model: LlamaForCausalLM, ids: list[int], start: int, cache: DynamicCache) -> torch.Tensor:
    input_ids = torch.tensor([ids], dtype=torch.long)  # (1, T)
    position_ids = torch.arange(start, start + len(ids)).unsqueeze(0)  # (1, T) absolute positions
    return model(input_ids=input_ids, position_ids=position_ids, cache=cache, use_cache=True).logits  # (1, T, V)
