"""A tiny, randomly initialised Llama with a byte-level tokenizer, for tests and plumbing.

It has what real models have (RoPE, grouped-query attention, a real tokenizer) at a size that
exports in seconds; its outputs are meaningless text.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

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


def build_tiny_llama(output_dir: Path, seed: int = 0, num_layers: int = 2) -> Path:
    """Write a HF model directory (config, safetensors, tokenizer) and return its path."""
    torch.manual_seed(seed)
    tokenizer = build_tokenizer()
    config = LlamaConfig(
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
        architectures=["LlamaForCausalLM"],
    )
    model = LlamaForCausalLM(config).eval()
    # Larger-than-default initialisation so attention is not uniform and greedy text varies.
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() == 2:
                parameter.normal_(0.0, 0.2)
    output_dir = Path(output_dir)
    model.save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)
    return output_dir
