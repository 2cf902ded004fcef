"""Architecture of the reference model: a small LlamaForCausalLM (RoPE, grouped-query attention).

Sized for the CPU budget: at hidden 192 and 4 layers (1.6M parameters) one thread trains at
~3-4k tokens/s with bf16 autocast. A hidden-128 model processed 1.4x more tokens per second,
but its recall rose more slowly per token in a side-by-side run, so the larger one is kept.
Four layers leave room for the circuits the chain of thought needs: previous-token heads that
gather a fact's right-hand side onto its defined name, a lookup keyed on that name, a
read-back of the model's own intermediate results, and a small addition table in the MLPs.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import LlamaConfig, LlamaForCausalLM

from kvpop.reference.tokenizer import BOS, EOS, PAD, VOCAB


@dataclass(frozen=True)
class ReferenceModelConfig:
    hidden_size: int = 192
    num_layers: int = 4
    num_attention_heads: int = 6  # head_dim 32
    num_key_value_heads: int = 2  # grouped-query attention: 3 query heads share one KV head
    intermediate_size: int = 512
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
