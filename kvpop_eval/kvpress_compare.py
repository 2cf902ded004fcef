"""Side by side with an outside peer: NVIDIA kvpress presses on the same HF model and tasks, as rows
for the quality table of `kvpop_eval.quality --sweep`.

Two steps in two environments, because kvpress 0.5.5 pins transformers<5.3 and numpy 2 while the
engine keeps numpy<2:

    # in .venv-kvpress (make kvpress-env): greedy generation under every press -> kvpress.json
    python -m kvpop_eval.kvpress_compare run --model models/reference --tasks build/tasks/test-512.jsonl \
        --out build/kvpress/kvpress.json
    # in .venv: merge the rows into an existing sweep (sweep.json, sweep.md, plot regenerated with
    # kvpop_eval.quality's own table and plot)
    python -m kvpop_eval.kvpress_compare merge --kvpress build/kvpress/kvpress.json --sweep-dir build/results/quality-reference-2048

What runs (kvpress's own classes, read from its 0.5.5 source, not re-implemented):
- `kvpress:NAME`: the press at `compression_ratio=r` during prefill, kvpress's native use. It
  prunes r of the PROMPT once, after every prompt token was seen with full attention, and keeps
  every generated token.
- `kvpress:NAME+decoding`: `PrefillDecodingPress` holding the cache at the engine's budget for the
  same r, B = ceil((1 - r) * (prompt + max_tokens)) slots per head (`CacheConfig.resolve_budget`):
  the prefill press prunes the prompt to the budget, then `DecodingPress` (same scorer) prunes back
  every `interval` generated tokens, so no query ever sees more than B cached tokens plus itself.
- `kvpress:NAME+question` (`--variants question`; tasks need "context" and "question", as
  kvpop_eval.english_tasks writes them): kvpress's question-answering use, `pipe(context,
  question=...)`. The press prunes r of the CONTEXT's cache only; the rest of the prompt (blank
  line, question, end of turn, assistant header) is then fed uncompressed and every generated token
  is kept. The tokens are the engine's own chat-templated prompt cut where the context ends
  (kvpress's pipeline would drop the blank line and tokenize the halves apart). The press is thus
  blind to the question, as kvpress intends (one compressed context, many questions): in
  `kvpress:snapkv` the question sits in SnapKV's 64-token observation window; here it cannot.

Compression. The project's is 1 - budget / tokens seen (prompt + generated tokens whose keys
entered the cache), and its sweep targets r over prompt + max_tokens. kvpress's `compression_ratio`
is a fraction of the prompt only: keeping (1 - r) P of P prompt tokens and all G generated ones is
1 - ((1 - r) P + G) / (P + G) = r P / (P + G) in the project's terms, less than r. Every row
carries both: `prompt_compression` (kvpress's) and `compression_achieved` (the project's, measured
at the end of each generation as the engine does). In `+question` rows r applies to the C context
tokens; the Q = P - C tokens after them are all kept and count as kept prompt tokens, so
prompt_compression = 1 - ((1 - r) C + Q) / P, a little under r; those rows add
`context_compression` = 1 - kept / C (kvpress's ratio as reached).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvpop_eval.provenance import stamp
from kvpop_eval.quality.report import markdown_table, plot_sweep
from kvpop_eval.quality.tasks_io import SWEEP_COMPRESSIONS, encode, load_tasks, scorer

COMPRESSIONS = tuple(ratio for ratio in SWEEP_COMPRESSIONS if ratio)  # the full cache at 0 is the engine's row
PRESS_NAMES = ("streaming_llm", "snapkv", "expected_attention", "knorm")
VARIANTS = ("prefill", "decoding", "question")
DEFAULT_VARIANTS = ("prefill", "decoding")  # `question` needs tasks with "context" and "question"
SUFFIXES = {"prefill": "", "decoding": "+decoding", "question": "+question"}  # policy = kvpress:NAME + suffix
SINKS = 4  # the engine's default CacheConfig.sinks; StreamingLLM and ExpectedAttention keep as many


@dataclass(frozen=True)
class PressSpec:
    """How one kvpress scorer is built for prefill and for decoding.

    Query-based scorers score from the buffered hidden states of the last `decoding_interval`
    generated tokens, so they need that buffer longer than their own window (SnapKV's observation
    window, ExpectedAttention's sinks); key-only scorers prune every step.
    """

    class_name: str
    decoding_interval: int
    prefill_options: dict[str, Any] = field(default_factory=dict)
    decoding_options: dict[str, Any] = field(default_factory=dict)

    def build(self, kvpress: Any, phase: str, compression_ratio: float = 0.0) -> Any:
        options = self.prefill_options if phase == "prefill" else self.decoding_options
        return getattr(kvpress, self.class_name)(compression_ratio=compression_ratio, **options)


PRESSES: dict[str, PressSpec] = {
    "streaming_llm": PressSpec("StreamingLLMPress", 1, {"n_sink": SINKS}, {"n_sink": SINKS}),
    "snapkv": PressSpec("SnapKVPress", 16, {}, {"window_size": 8}),  # prefill window: kvpress's 64
    "expected_attention": PressSpec("ExpectedAttentionPress", 16, {"n_sink": SINKS}, {"n_sink": SINKS}),
    "knorm": PressSpec("KnormPress", 1),
}


# --- run (in .venv-kvpress) ---------------------------------------------------------------------


def policy_name(name: str, variant: str) -> str:
    return f"kvpress:{name}{SUFFIXES[variant]}"


def split_prompt(tokenizer: Any, task: dict) -> tuple[list[int], int]:
    """The engine's token ids of task["prompt"] (`encode`) and how many of them are the context: the
    prompt's user turn is f"{context}\n\n{question}", so the context ends at a known character, and
    its tokens are the longest common prefix of the prompt's ids and the ids of the prompt cut there
    (a token straddling the cut, e.g. a final "." merged with the blank line, goes to the question)."""
    context, question, prompt = task["context"], task["question"], task["prompt"]
    start = prompt.rfind(f"{context}\n\n{question}")
    if not context or start < 0:
        raise ValueError(f"task {task.get('index', '?')}: its prompt does not hold its context, a blank line, then its question")
    ids = encode(tokenizer, prompt)
    head = encode(tokenizer, prompt[: start + len(context)])
    common = 0
    while common < min(len(ids), len(head)) and ids[common] == head[common]:
        common += 1
    if not 0 < common < len(ids):
        raise ValueError(f"task {task.get('index', '?')}: no context/question split in its {len(ids)} tokens ({common})")
    return ids, common


def engine_budget(compression: float, prompt_tokens: int, max_tokens: int) -> int:
    """kvpop.request.CacheConfig.resolve_budget for a compression target."""
    return max(1, math.ceil((1.0 - compression) * (prompt_tokens + max_tokens)))


def ratio_keeping(kept: int, length: int) -> float:
    """The compression_ratio with which a ScorerPress keeps exactly `kept` of `length` tokens
    (it keeps int(length * (1 - ratio)))."""
    return 0.0 if kept >= length else 1.0 - (kept + 0.5) / length


@dataclass
class Generation:
    output_ids: list[int]
    prompt_tokens: int
    kept_after_prefill: int  # cache length once the whole prompt is in (pruned context + question for +question)
    final_cache: int  # cache length after the last forward
    peak_cache: int  # largest cache length held between forwards
    budget: int | None  # the +decoding variant's cap (engine budget); None when generated tokens are all kept
    context_tokens: int | None = None  # +question: the prompt's first tokens, the only ones the press saw
    kept_context: int | None = None  # +question: cache length once the press has pruned the context

    @property
    def tokens_seen(self) -> int:
        # As the engine counts: the last sampled token is never fed, so its key never enters the cache.
        return self.prompt_tokens + len(self.output_ids) - 1

    def compressions(self) -> dict[str, float]:
        """The row columns of one generation (see the module docstring)."""
        measured = {
            "compression": 1.0 - self.final_cache / self.tokens_seen,
            "prompt_compression": 1.0 - self.kept_after_prefill / self.prompt_tokens,
        }
        if self.context_tokens is not None:
            measured["context_compression"] = 1.0 - self.kept_context / self.context_tokens
        return measured


class PressRunner:
    """Greedy generation of one task under one press, as kvpress's own pipeline does it (prefill
    inside the press's context manager, then feed the rest with explicit position ids, since a pruned
    cache no longer tells the true position). Without `context_tokens` the press prefills the whole
    prompt, question included, as the engine sees it; with it, as the pipeline's `_forward`: the
    press prefills the context alone, and the question (+ assistant header) follows outside it."""

    def __init__(self, model_dir: Path, max_tokens: int):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.max_tokens = max_tokens
        eos = self.model.generation_config.eos_token_id
        eos = eos if isinstance(eos, list) else [eos]
        self.eos_ids = {token for token in [*eos, self.tokenizer.eos_token_id] if token is not None}
        config = self.model.config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        # Key + value bytes of one token across every layer and KV head (float32).
        self.token_bytes = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * 4

    def generate(self, prompt_ids: list[int], press: Any, budget: int | None, context_tokens: int | None = None) -> Generation:
        import contextlib

        from transformers import DynamicCache

        torch = self.torch
        cache = DynamicCache()
        output_ids: list[int] = []
        split = len(prompt_ids) if context_tokens is None else context_tokens
        with torch.inference_mode(), contextlib.ExitStack() as pressing:
            if press is not None:
                pressing.enter_context(press(self.model))
            logits = self.model(input_ids=torch.tensor([prompt_ids[:split]]), past_key_values=cache, logits_to_keep=1).logits
            kept_context = cache.get_seq_length()
            if split < len(prompt_ids):
                pressing.close()  # the press is done: the question enters the cache whole, as in kvpress's pipeline
                logits = self.model(
                    input_ids=torch.tensor([prompt_ids[split:]]),
                    past_key_values=cache,
                    position_ids=torch.arange(split, len(prompt_ids)).unsqueeze(0),
                    logits_to_keep=1,
                ).logits
            kept_after_prefill = peak = cache.get_seq_length()
            position = len(prompt_ids)
            while True:
                token = int(logits[0, -1].argmax())
                output_ids.append(token)
                if token in self.eos_ids or len(output_ids) >= self.max_tokens:
                    break
                logits = self.model(
                    input_ids=torch.tensor([[token]]),
                    past_key_values=cache,
                    position_ids=torch.tensor([[position]]),
                ).logits
                position += 1
                peak = max(peak, cache.get_seq_length())
        return Generation(output_ids, len(prompt_ids), kept_after_prefill, cache.get_seq_length(), peak, budget,
                          context_tokens, None if context_tokens is None else kept_context)


def build_press(kvpress: Any, name: str, variant: str, compression: float, prompt_tokens: int, max_tokens: int) -> tuple[Any, int | None]:
    """The press for one task (the +decoding budget depends on the prompt's length) and its budget;
    +question uses the prefill press (on the context only: `PressRunner.generate`)."""
    spec = PRESSES[name]
    if variant in ("prefill", "question"):
        return spec.build(kvpress, "prefill", compression), None
    budget = engine_budget(compression, prompt_tokens, max_tokens)
    # Between two prunings `interval - 1` generated tokens pile up; keeping that much less leaves
    # every query at most `budget` cached tokens plus itself.
    target = budget - spec.decoding_interval + 1
    if target < 1:
        raise ValueError(f"{name}: budget {budget} is smaller than the decoding interval {spec.decoding_interval}")
    press = kvpress.PrefillDecodingPress(
        prefilling_press=spec.build(kvpress, "prefill", ratio_keeping(target, prompt_tokens)),
        decoding_press=kvpress.DecodingPress(
            base_press=spec.build(kvpress, "decoding"),
            compression_interval=spec.decoding_interval,
            target_size=target,
        ),
    )
    return press, budget


def summarize(policy: str, variant: str, compression: float, records: list[dict], seconds: float, token_bytes: int) -> dict:
    count = len(records)

    def mean(key: str) -> float:
        return sum(record[key] for record in records) / count

    extra = {"context_compression": mean("context_compression")} if "context_compression" in records[0] else {}
    return {
        "policy": policy,
        "compression": compression,
        "accuracy": mean("correct"),
        "compression_achieved": mean("compression"),
        "mean_budget": mean("peak_cache"),
        "max_peak_kv_bytes": max(record["peak_cache"] for record in records) * token_bytes,
        "generated_tokens_per_s": sum(record["output_tokens"] for record in records) / seconds,
        "tasks": count,
        "prompt_compression": mean("prompt_compression"),
        **extra,
        "variant": variant,
        "seconds": seconds,
    }


def run(args: argparse.Namespace) -> int:
    import torch
    import transformers
    from tqdm import tqdm

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    torch.set_num_threads(args.threads)
    import kvpress

    is_correct = scorer(args.scoring)
    names = [name.strip() for name in args.presses.split(",") if name.strip()]
    variants = [variant.strip() for variant in args.variants.split(",") if variant.strip()]
    compressions = [float(ratio) for ratio in args.compressions.split(",")]
    unknown = sorted(set(names) - set(PRESSES)) + sorted(set(variants) - set(VARIANTS))
    if unknown or not all(0.0 < ratio < 1.0 for ratio in compressions):
        raise SystemExit(f"unknown presses/variants {unknown} (known: {', '.join(PRESSES)}; {', '.join(VARIANTS)}) "
                         f"or a compression outside (0, 1): {compressions}")
    try:
        tasks = load_tasks(args.tasks, args.limit, split="question" in variants)
    except ValueError as error:
        raise SystemExit(str(error)) from None
    runner = PressRunner(args.model, args.max_tokens)
    prompts = [encode(runner.tokenizer, task["prompt"]) for task in tasks]
    # +question: how many prompt tokens are context (split_prompt's ids are `prompts`' own).
    context_lengths = [split_prompt(runner.tokenizer, task)[1] for task in tasks] if "question" in variants else []

    configs = [(None, "full", 0.0)] + [(name, variant, ratio) for name in names for variant in variants for ratio in compressions]
    progress = tqdm(total=len(configs) * len(tasks), unit="task", dynamic_ncols=True, file=sys.stderr)
    results, full_details, full_accuracy = [], [], 0.0
    for name, variant, ratio in configs:
        policy = "kvpress:full" if name is None else policy_name(name, variant)
        progress.set_description(f"{policy} @ {ratio:.0%}")
        records, start = [], time.perf_counter()
        for number, (task, prompt_ids) in enumerate(zip(tasks, prompts)):
            press, budget = (None, None) if name is None else build_press(kvpress, name, variant, ratio, len(prompt_ids), args.max_tokens)
            context_tokens = context_lengths[number] if variant == "question" else None
            generation = runner.generate(prompt_ids, press, budget, context_tokens)
            if budget is not None and generation.peak_cache > budget:
                raise RuntimeError(f"{policy} @ {ratio}: held {generation.peak_cache} tokens over the budget {budget}")
            text = runner.tokenizer.decode(generation.output_ids, skip_special_tokens=True)
            records.append({
                "correct": bool(is_correct(text, task["answer"])),
                **generation.compressions(),
                "peak_cache": generation.peak_cache,
                "output_tokens": len(generation.output_ids),
            })
            if args.show:
                tqdm.write(f"{policy} @ {ratio:.0%} task {task.get('index', number)}: {text!r} "
                           f"(answer {task['answer']!r}, {generation.prompt_tokens} prompt tokens"
                           + (f", {context_tokens} of them context, {generation.kept_context} kept" if context_tokens else "")
                           + ")", file=sys.stderr)
            if name is None:
                full_details.append({"index": task.get("index", len(full_details)), "answer": str(task["answer"]),
                                     "generated": text, "correct": records[-1]["correct"]})
            progress.update()
            progress.set_postfix(accuracy=f"{sum(r['correct'] for r in records) / len(records):.3f}")
        row = summarize(policy, variant, ratio, records, time.perf_counter() - start, runner.token_bytes)
        row["correct_by_task"] = "".join("1" if record["correct"] else "0" for record in records)  # task order, as kvpop_eval.quality
        if name is None:
            full_accuracy = row["accuracy"]
        else:
            row["press_first_task"] = repr(build_press(kvpress, name, variant, ratio, len(prompts[0]), args.max_tokens)[0])
            if variant == "decoding":
                row["decoding_interval"] = PRESSES[name].decoding_interval
            results.append(row)
        context = f", context {row['context_compression']:.1%}" if "context_compression" in row else ""
        tqdm.write(f"{policy} @ {ratio:.0%}: accuracy {row['accuracy']:.3f}, "
                   f"compression achieved {row['compression_achieved']:.1%} (prompt {row['prompt_compression']:.1%}{context}), "
                   f"{row['seconds']:.0f} s", file=sys.stderr)
        write_report(args, tasks, results, full_accuracy, full_details, complete=False)  # a cut run keeps its rows
    progress.close()
    write_report(args, tasks, results, full_accuracy, full_details, complete=True)
    print(f"wrote {args.out}: {len(results)} kvpress rows, HF full-cache accuracy {full_accuracy:.3f} on {len(tasks)} tasks")
    return 0


def write_report(args: argparse.Namespace, tasks: list[dict], results: list[dict], full_accuracy: float,
                 full_details: list[dict], complete: bool) -> None:
    import torch
    import transformers

    zero_rows = [
        {"policy": policy, "compression": 0.0, "accuracy": full_accuracy, "compression_achieved": 0.0,
         "tasks": len(tasks), "note": "no eviction at 0%: the full cache (HF torch, this environment)"}
        for policy in dict.fromkeys(row["policy"] for row in results)
    ]
    report = {
        "kvpress_version": _version("kvpress"),
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "model": str(args.model),
        "tasks_file": str(args.tasks),
        "tasks_sha256": hashlib.sha256(Path(args.tasks).read_bytes()).hexdigest(),
        "tasks": len(tasks),
        "scoring": args.scoring,
        "max_tokens": args.max_tokens,
        "complete": complete,
        "full_accuracy_hf": full_accuracy,
        "definitions": {
            "compression": "the sweep's target r; for kvpress:NAME kvpress's compression_ratio on the prompt, "
                           "for kvpress:NAME+decoding the engine's budget ceil((1-r)(prompt+max_tokens)) held throughout, "
                           "for kvpress:NAME+question kvpress's compression_ratio on the context alone (the question is fed after, whole)",
            "compression_achieved": "1 - cached tokens / tokens seen (prompt + generated tokens fed), at the end, as the engine reports",
            "prompt_compression": "1 - prompt tokens kept after the prefill press / prompt tokens (kvpress's compression_ratio); "
                                  "+question rows keep every question token: 1 - (kept context + question) / prompt",
            "context_compression": "+question rows only: 1 - context tokens kept / context tokens (kvpress's ratio as reached)",
            "mean_budget": "mean over tasks of the largest cache length held between forward passes",
            "max_peak_kv_bytes": "that largest length x key+value bytes per token over all layers and KV heads (float32); "
                                 "the prefill itself briefly holds the whole prompt in the layer being pruned",
            "generated_tokens_per_s": "HF torch eager decoding, batch 1, in .venv-kvpress: not comparable with the engine's",
        },
        "full_hf_rows": full_details,
        "results": [*zero_rows, *results],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(stamp(report), indent=2) + "\n")


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


# --- merge (in .venv) ---------------------------------------------------------------------------


def merge(kvpress_json: Path, sweep_dir: Path) -> list[dict]:
    """Add the rows of `kvpress_json` to `sweep_dir/sweep.json` (replacing the kvpress rows of the same
    press and compression; other presses' rows, from an earlier run on the same tasks, stay), then
    rewrite sweep.md and the plot with kvpop_eval.quality's own table and plot."""
    sweep_path = sweep_dir / "sweep.json"
    sweep = json.loads(sweep_path.read_text())
    peer = json.loads(kvpress_json.read_text())
    if sweep.get("tasks_sha256") and peer["tasks_sha256"] != sweep["tasks_sha256"]:
        raise SystemExit(f"{kvpress_json} ran {peer['tasks_file']}, not the sweep's {sweep.get('tasks_file')} "
                         "(their sha256 differ): run eval-kvpress on the same tasks")
    if peer["tasks"] != sweep["tasks"] or peer["scoring"] != sweep["scoring"]:
        print(f"warning: kvpress ran {peer['tasks']} tasks ({peer['scoring']}), the sweep {sweep['tasks']} ({sweep['scoring']})",
              file=sys.stderr)
    earlier = sweep.get("kvpress") or {}
    if earlier and earlier.get("full_accuracy_hf") != peer["full_accuracy_hf"]:
        print(f"warning: the sweep's kvpress rows saw a Hugging Face full cache of {earlier['full_accuracy_hf']:.3f}, "
              f"{kvpress_json} one of {peer['full_accuracy_hf']:.3f}", file=sys.stderr)
    versions = ("kvpress_version", "transformers_version", "torch_version")
    if earlier and any(earlier.get(key) != peer[key] for key in versions):
        print(f"warning: the sweep's kvpress rows ran {[earlier.get(key) for key in versions]}, "
              f"{kvpress_json} {[peer[key] for key in versions]}", file=sys.stderr)
    replaced = {(row["policy"], row["compression"]) for row in peer["results"]}
    kept = [row for row in sweep["results"] if not row["policy"].startswith("kvpress:")
            or (earlier and (row["policy"], row["compression"]) not in replaced)]
    summary = kept + peer["results"]
    compressions = tuple(sorted({row["compression"] for row in summary}))
    engine_full = next(row["accuracy"] for row in summary if row["policy"] == "full")
    sweep["results"] = summary
    sweep["kvpress"] = {key: peer[key] for key in ("kvpress_version", "transformers_version", "torch_version", "model",
                                                    "tasks_file", "tasks_sha256", "max_tokens", "full_accuracy_hf", "definitions")}
    sweep_path.write_text(json.dumps(sweep, indent=2) + "\n")
    note = (
        f"\nkvpress {peer['kvpress_version']} rows (`kvpop_eval/kvpress_compare.py`, HF torch, greedy): `kvpress:NAME` prunes "
        "the given fraction of the prompt once after prefill and keeps every generated token; `kvpress:NAME+decoding` "
        "holds the engine's budget for the same compression with PrefillDecodingPress + DecodingPress; "
        "`kvpress:NAME+question` prunes the given fraction of the context alone (kvpress's question-answering use) and "
        "feeds the question after it, uncompressed. "
        f"Full cache: engine {engine_full:.3f}, HF torch {peer['full_accuracy_hf']:.3f}. "
        "Compression actually reached (1 - cached / tokens seen):\n\n"
        "| kvpress policy | " + " | ".join(f"{ratio:.0%}" for ratio in compressions if ratio) + " |\n"
        "|---|" + "---|" * sum(1 for ratio in compressions if ratio) + "\n"
    )
    pressed = [row for row in summary if row["policy"].startswith("kvpress:")]
    achieved = {(row["policy"], row["compression"]): row["compression_achieved"] for row in pressed}
    for policy in dict.fromkeys(row["policy"] for row in pressed):
        cells = [f"{achieved[(policy, ratio)]:.1%}" if (policy, ratio) in achieved else "-" for ratio in compressions if ratio]
        note += f"| {policy} | " + " | ".join(cells) + " |\n"
    (sweep_dir / "sweep.md").write_text(markdown_table(summary, compressions) + note)
    plot_sweep(summary, sweep_dir / "accuracy_vs_compression.png")
    return summary


# --- command line -------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvpop_eval.kvpress_compare", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    run_parser = commands.add_parser("run", help="generate under every press (in .venv-kvpress) -> kvpress.json")
    run_parser.add_argument("--model", type=Path, required=True, help="Hugging Face model directory")
    run_parser.add_argument("--tasks", type=Path, required=True, help="JSONL with 'prompt' and 'answer' per line")
    run_parser.add_argument("--out", type=Path, required=True, help="kvpress.json to write")
    run_parser.add_argument("--presses", default=",".join(PRESS_NAMES))
    run_parser.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                            help="prefill (kvpress native), decoding (engine budget), question (the press sees the context "
                                 "only, the question follows uncompressed; needs 'context' and 'question' per task)")
    run_parser.add_argument("--compressions", default=",".join(str(ratio) for ratio in COMPRESSIONS))
    run_parser.add_argument("--max-tokens", type=int, default=64, help="as kvpop_eval.quality --max-tokens")
    run_parser.add_argument("--limit", type=int, default=None, help="first N tasks only")
    run_parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    run_parser.add_argument("--scoring", choices=["final_answer", "contains"], default="final_answer", help="as kvpop_eval.quality --scoring")
    run_parser.add_argument("--show", action="store_true", help="print every generated answer (smoke checks)")
    merge_parser = commands.add_parser("merge", help="add kvpress.json rows to a kvpop_eval.quality sweep (in .venv)")
    merge_parser.add_argument("--kvpress", type=Path, required=True)
    merge_parser.add_argument("--sweep-dir", type=Path, required=True, help="folder with sweep.json from kvpop_eval.quality --sweep")
    args = parser.parse_args(argv)
    if args.command == "run":
        return run(args)
    summary = merge(args.kvpress, args.sweep_dir)
    print(f"merged {sum(row['policy'].startswith('kvpress:') for row in summary)} kvpress rows into {args.sweep_dir}: "
          "sweep.json, sweep.md, accuracy_vs_compression.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
