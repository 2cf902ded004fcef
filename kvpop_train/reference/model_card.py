"""MODEL_CARD.md of the shipped reference model, rendered from measured figures only.

Training writes the card at every export from its summary; evaluation re-renders it with the
accuracy table, so the card never states a number that was not measured.
"""

from __future__ import annotations

from kvpop_tasks import TaskConfig, generate_task
from kvpop_train.reference.curriculum import STAGES


def render_card(summary: dict, evaluation: dict | None = None) -> str:
    config = summary["model_config"]
    example = generate_task(TaskConfig(context_tokens=64, hops=2, num_facts=8, distractors=1), "test", 0)
    lines = [
        "# KVpop reference model",
        "",
        "A small `LlamaForCausalLM` trained from scratch on the KVpop long-context multi-step arithmetic",
        "tasks (`kvpop_tasks`), so that KV-cache eviction can be measured on a model that really reads",
        "its context. Reproduce with `make reference-model` (resumes from `build/checkpoints/reference/`);",
        "measure with `make eval-reference`.",
        "",
        "## Architecture",
        "",
        f"- Llama decoder, {config['num_layers']} layers, hidden {config['hidden_size']}, MLP {config['intermediate_size']},",
        f"  {config['num_attention_heads']} query heads / {config['num_key_value_heads']} KV heads (grouped-query attention),",
        f"  RoPE (theta {config['rope_theta']:g}), tied embeddings, {summary.get('parameters', 'n/a')} parameters,",
        f"  positions up to {config['max_position_embeddings']}.",
        "- Word-level tokenizer (`tokenizer.json`, Hugging Face `tokenizers`): one token per word of the",
        "  task language (numbers 0..99, operators +1..+9 / -1..-9, running offsets -54..+54, 52 one-letter",
        "  names, punctuation, 50",
        "  filler words) plus `<pad>`, `<bos>` (added automatically), `<eos>`, `<unk>`.",
        "",
        "## Data",
        "",
        "Facts name the variable first (`b 12 ;` defines b = 12, `c b +5 ;` defines c = b + 5) and are",
        "scattered through filler words and distractor facts (other chains, and near-miss facts that use a",
        "chain variable on their right-hand side). The question `? c :` is answered by a chain of thought",
        "that copies each fact of the chain from the context, writes the running offset after each (reading",
        "its own previous result back), adds it to the root's number, and answers after `#`:",
        "",
        "```",
        f"prompt: {example.prompt}",
        f"answer: {example.target}",
        "```",
        "",
        "Scoring is exact match of the number after `#`. Benchmark tasks: 3 hops (4 facts needed),",
        "about one fact per 12 tokens (at most 48), a quarter of the non-chain facts near-miss.",
        "",
        "## Training recipe",
        "",
        "AdamW (fp32 on CPU), loss only on chain-of-thought tokens, drill targets and EOS. The first stage",
        "mixes dense drills (lookups of facts back to back, and repeated runs of words) that make the",
        "name-keyed copy carry most of the loss (kvpop_train/reference/drills.py). A curriculum advances",
        "when the teacher-forced validation accuracy of its gate distribution (every reasoning token right)",
        "reaches the threshold; later stages keep sampling the shorter distributions.",
        "",
        "| stage | gate | passed at step | tokens | hours | best gate accuracy |",
        "|---|---|---|---|---|---|",
    ]
    for record in summary["stages"]:
        stage = next(s for s in STAGES if s.name == record["name"])
        if record["passed_step"] is None:
            lines.append(f"| {record['name']} | {_describe(stage.gate)} | not yet | - | - | {record['best_accuracy']:.3f} |")
            continue
        lines.append(
            f"| {record['name']} | {_describe(stage.gate)} | {record['passed_step']} | "
            f"{_millions(record['passed_tokens'])} | {record['passed_seconds'] / 3600:.2f} | {record['best_accuracy']:.3f} |"
        )
    lines += [
        "",
        f"Trained so far: {summary['step']} steps, {_millions(summary['tokens'])} tokens, "
        f"{summary['hours']:.2f} hours of CPU wall time ({summary.get('tokens_per_second', 0):.0f} tokens/s "
        f"on {summary.get('threads', '?')} thread(s)).",
        *[f"Run change at {note}." for note in summary.get("notes", [])],
        "",
        "## Measured accuracy (test split, greedy, exact match)",
        "",
    ]
    if evaluation is None:
        lines.append("Not measured yet: run `make eval-reference`.")
    else:
        lines += [
            f"StreamingLLM keeps the first {evaluation['sink_tokens']} tokens and the most recent ones, "
            f"{evaluation['keep_fraction']:.0%} of the prompt plus max_tokens ({1 - evaluation['keep_fraction']:.0%} "
            "compression; the engine's policy, measured by kvpop_eval.quality).",
            "",
            "| context tokens | tasks | full cache | StreamingLLM |",
            "|---|---|---|---|",
        ]
        for row in evaluation["results"]:
            lines.append(f"| {row['context_tokens']} | {row['tasks']} | {row['full']:.3f} | {row['streaming']:.3f} |")
    lines += [
        "",
        "## Intended use",
        "",
        "A measuring instrument for KV-cache eviction policies in this project, not a general model.",
        "",
    ]
    return "\n".join(lines)


def _describe(config: TaskConfig) -> str:
    hops = f"{config.min_hops}-{config.hops}" if config.min_hops is not None else str(config.hops)
    return f"{config.context_tokens} tokens, {config.fact_count} facts, hops {hops}, {config.questions} question(s)"


def _millions(tokens: int) -> str:
    return f"{tokens / 1e6:.1f}M"
