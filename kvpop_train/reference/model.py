"""Architecture of the reference model: a small LlamaForCausalLM (RoPE, grouped-query attention).

Two layers, hidden 128, MLP 1024 (0.9M parameters): every step of the task's chain of thought is either a
copy of one fact keyed on its name (a previous-token head, then a head matching names: two
layers) or arithmetic on the last few tokens (attention gathers, the MLP adds). Depth costs
time to the one thing that forms slowly: in side-by-side runs a 2-layer model formed the
name-keyed copy after ~4M tokens while a 4-layer one had not after 7M, and the small model
trains at ~45k tokens/s on two cores in fp32 (training notes: docs/reference_model/TRAINING_NOTES.md at commit 4e61d25).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvpop_train.reference.tokenizer import BOS, EOS, PAD, VOCAB


@dataclass(frozen=True)
class ReferenceModelConfig:
    hidden_size: int = 128
    num_layers: int = 2
    num_attention_heads: int = 4  # head_dim 32
    num_key_value_heads: int = 2  # grouped-query attention: 2 query heads share one KV head
    intermediate_size: int = 1024  # wide: the running offsets are addition tables (measured: 256 plateaued)
    max_position_embeddings: int = 4096 + 256  # longest benchmark prompt plus its chain of thought
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError("hidden_size must be divisible by num_attention_heads")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")

    def to_llama_config(self) -> LlamaConfig:
        return LlamaConfig(
            vocab_size=len(VOCAB),
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            max_position_embeddings=self.max_position_embeddings,
            rope_theta=self.rope_theta,
            tie_word_embeddings=True,
            bos_token_id=VOCAB[BOS],
            eos_token_id=VOCAB[EOS],
            pad_token_id=VOCAB[PAD],
        )


def build_model(config: ReferenceModelConfig) -> LlamaForCausalLM:
    model = LlamaForCausalLM(config.to_llama_config())
    model.config._attn_implementation = "sdpa"
    return model


@torch.no_grad()
def widen_mlp(
    model: LlamaForCausalLM, config: ReferenceModelConfig, intermediate_size: int
) -> tuple[LlamaForCausalLM, ReferenceModelConfig]:
    """The same function with wider MLPs: new units get small random inputs and zero outputs.

    Lets a run that has formed its retrieval circuit (the slow, stochastic part) gain capacity for
    the addition tables without starting over (net2net-style growth; the model computes exactly
    what it computed before until training moves the new units).
    """
    if intermediate_size <= config.intermediate_size:
        raise ValueError(f"widen to more than {config.intermediate_size} units, got {intermediate_size}")
    wider_config = replace(config, intermediate_size=intermediate_size)
    wider = build_model(wider_config)
    old = config.intermediate_size
    wider_state = wider.state_dict()
    for name, tensor in model.state_dict().items():
        target = wider_state[name]
        if name.endswith(("gate_proj.weight", "up_proj.weight")):  # (intermediate, hidden)
            target[:old] = tensor
            target[old:].normal_(0.0, 0.02)
        elif name.endswith("down_proj.weight"):  # (hidden, intermediate)
            target[:, :old] = tensor
            target[:, old:] = 0.0
        else:
            target.copy_(tensor)
    return wider, wider_config
