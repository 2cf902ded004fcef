"""A randomly initialised Llama of realistic shape for the speed harness (random weights: speed only).

    python -m kvpop_eval.bench.bench_model --out DIR      # writes DIR/hf (HF model) and DIR/onnx (exported)

Why not the tiny test model: at hidden 64 the per-step numpy bookkeeping dominates and no cache
policy can show a speed difference. Why random weights: decode cost does not depend on weight values.
"""

from __future__ import annotations

import argparse
from pathlib import Path

BENCH_SHAPE = dict(
    hidden_size=512,
    intermediate_size=1536,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=2,  # grouped-query attention 8/2
    head_dim=64,
    vocab_size=32000,
    max_position_embeddings=20480,  # above the longest benchmark context (16k + generated)
)


def build_bench_llama(output_dir: Path, seed: int = 0) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from export.tiny_model import build_tokenizer

    torch.manual_seed(seed)
    tokenizer = build_tokenizer()  # a real tokenizer is only needed by the export pipeline's bookkeeping
    config = LlamaConfig(
        **BENCH_SHAPE,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        architectures=["LlamaForCausalLM"],
    )
    model = LlamaForCausalLM(config).eval()
    output_dir = Path(output_dir)
    model.save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)
    return output_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvpop_eval.bench.bench_model", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    from export.pipeline import export_model

    hf_dir = build_bench_llama(args.out / "hf")
    export_model(hf_dir, args.out / "onnx")
    print(f"wrote {args.out}/hf and {args.out}/onnx")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
