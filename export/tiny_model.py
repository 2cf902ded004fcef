"""A tiny, randomly initialised Llama with a byte-level tokenizer, for tests and plumbing.

It has what real models have (RoPE, grouped-query attention, a real tokenizer) at a size that
exports in seconds; its outputs are meaningless text.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "KVpop keeps a fixed budget of key and value slots for every attention head.",
    "Tokens leave the protected window and compete for long-range slots.",
    "Let a = 7. Let b = a + 5. What is b? b = 12.",
] * 8


def build_tokenizer() -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=list(SPECIAL_TOKENS.values()),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, **SPECIAL_TOKENS)


ARCHITECTURES = {
    "LlamaForCausalLM": ("LlamaConfig", "LlamaForCausalLM"),
    "MistralForCausalLM": ("MistralConfig", "MistralForCausalLM"),
    "Qwen2ForCausalLM": ("Qwen2Config", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("Qwen3Config", "Qwen3ForCausalLM"),
}


def build_tiny_model(output_dir: Path, architecture: str = "LlamaForCausalLM", seed: int = 0, num_layers: int = 2) -> Path:
    """Write a tiny HF model directory (config, safetensors, tokenizer) of a supported architecture."""
    import transformers

    config_name, model_name = ARCHITECTURES[architecture]
    torch.manual_seed(seed)
    tokenizer = build_tokenizer()
    config = getattr(transformers, config_name)(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,  # grouped-query attention, as in real models
        max_position_embeddings=65536,  # long enough for streams that outlive a test's checks
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        architectures=[architecture],
    )
    model = getattr(transformers, model_name)(config).eval()
    # Larger-than-default initialisation (biases too: Qwen2's q/k/v biases start at zero) so attention
    # is not uniform and greedy text varies.
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.dim() == 2 or name.endswith("proj.bias"):
                parameter.normal_(0.0, 0.2)
    output_dir = Path(output_dir)
    model.save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)
    return output_dir


def build_tiny_llama(output_dir: Path, seed: int = 0, num_layers: int = 2) -> Path:
    return build_tiny_model(output_dir, "LlamaForCausalLM", seed, num_layers)
