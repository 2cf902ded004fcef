"""Retrieval heads: the KV heads whose question attention finds the sentence the question asks about.

    python -m kvpop_train.scorer.retrieval_heads --model models/smollm2-135m-instruct \
        --texts build/scorer-texts/english.jsonl --out scorers/smollm2-135m-instruct/retrieval_heads.json

Summed over every KV head, the attention of a prompt's last queries mostly goes to the first paragraphs
and to frequent words, whatever the question asks; in a few heads it goes to the passage the question
is about (the retrieval heads of Wu et al., 2024, the heads RazorAttention and DuoAttention keep whole).
The query-aware pick (kvpop.policies.kvpop.query, `query_heads="retrieval"`) listens to those heads only.
They are a property of the base model, found once on needle-in-a-haystack prompts built from the
scorer's training texts (docstrings of the standard library, never the benchmark's haystack, and facts
phrased unlike any benchmark family): three sentences stating a number about a name are planted inside
a context's running text, the chat template the service uses asks for one of them, and a head scores a
hit when the planted sentence is among the `top` sentences its last `query_window` queries attend to
most (attention summed over the window and the head's query group, the largest over each sentence's
tokens, sentences cut as the service cuts a prompt: text_spans.TextSpans). The heads with the highest hit
rate are written to `retrieval_heads.json` beside the scorers; `make export` copies it into the model
repository, where the learned scorers' runtime reads it (scorer_spec.ScorerSpec). Heads found with the
training texts' own recall questions ("Which value does the text above give where it mentions X?") were
not these: SmolLM2-135M's question attention does not find an ordinary docstring sentence in any head,
so those questions calibrate nothing.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from kvpop.policies.kvpop.query import SPAN_POOLING
from kvpop.policies.kvpop.scorer_spec import RETRIEVAL_HEADS_FILE
from kvpop.policies.kvpop.text_spans import TextSpans, span_ends
from kvpop_train.scorer.english_texts import split_sentences
from kvpop_train.scorer.traces import capturing_attention

CAPTURE = "kvpop_retrieval_heads"


class _LastQueries:
    """Attention function that records, per layer, what the last `window` queries give every key
    (summed over those queries and each KV head's query group: (Hkv, S)), then runs SDPA as usual."""

    def __init__(self, window: int) -> None:
        self.window = window
        self.received: dict[int, torch.Tensor] = {}

    def __call__(self, module, query, key, value, attention_mask, scaling=None, **kwargs):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        query_heads, kv_heads, length = query.shape[1], key.shape[1], key.shape[2]
        last = query[0, :, -self.window :].float()  # (Hq, W, D)
        scaling = last.shape[-1] ** -0.5 if scaling is None else scaling
        logits = last @ key[0].float().repeat_interleave(query_heads // kv_heads, dim=0).transpose(1, 2) * scaling  # (Hq, W, S)
        rows = torch.arange(length - last.shape[1], length)[:, None]  # (W, 1) absolute query positions
        logits = logits.masked_fill(torch.arange(length)[None, :] > rows, float("-inf"))
        probs = torch.softmax(logits, dim=-1).sum(dim=1)  # (Hq, S)
        self.received[module.layer_idx] = probs.reshape(kv_heads, -1, length).sum(dim=1)  # (Hkv, S)
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)

    def take(self) -> torch.Tensor:
        """(L, Hkv, S) of the last forward."""
        received = torch.stack([self.received[index] for index in sorted(self.received)])
        self.received = {}
        return received


# Facts the calibration plants (none of them a phrasing of the benchmark's task families).
THINGS = ("access code", "room number", "order number", "locker number", "serial number", "ticket number", "account number")
NAMES = ("the north gate", "Maria Keller", "the blue warehouse", "Tomas Berg", "the harbour office", "the night train",
         "Anna Novak", "the east tower", "the old library", "Jonas Weber", "the river depot", "the glass studio")


def calibration_prompts(record: dict, rng: random.Random, per_context: int, facts: int = 3) -> list[tuple[str, str]]:
    """(user message, the planted sentence it asks about): `facts` sentences, each stating a number about a
    name, planted between two sentences of the context's paragraphs (inside running text); one is asked."""
    sentences = split_sentences(record["context"])
    prompts = []
    for _ in range(per_context):
        thing = rng.choice(THINGS)
        names = rng.sample(NAMES, facts)
        planted = [f"The {thing} of {name} is {rng.randrange(10**5, 10**6)}." for name in names]
        where = sorted(rng.sample(range(1, len(sentences)), facts))
        text = list(sentences)
        for index, sentence in sorted(zip(where, planted), reverse=True):
            text.insert(index, sentence)
        asked = rng.randrange(facts)
        prompts.append((" ".join(text) + f"\n\nWhat is the {thing} of {names[asked]}? Answer with the number only.", planted[asked]))
    return prompts


def sentence_ids(ids: list[int], tokenizer, vocab_size: int) -> torch.Tensor:
    """(S,) the span index of each token, as the service cuts a prompt for the query-aware pick
    (TextSpans with sentence pooling: a span ends after a token that ends a sentence or a line, and
    every MAX_SPAN tokens), so the heads are found with the spans they will pick from."""
    spans = TextSpans.of_prompt(ids, span_ends(tokenizer, vocab_size, SPAN_POOLING), SPAN_POOLING)
    return torch.from_numpy(spans.span)


@torch.no_grad()
def head_hit_rates(model, tokenizer, records: list[dict], query_window: int = 32, top: int = 3, per_context: int = 3,
                   max_tokens: int = 2048, progress: bool = True, seed: int = 0) -> tuple[torch.Tensor, int]:
    """(L, Hkv) the share of questions whose sentence is among each head's `top` sentences, and how many questions."""
    recorder = _LastQueries(query_window)
    hits, asked, rng = None, 0, random.Random(seed)
    with capturing_attention(model, CAPTURE, recorder):
        for record in tqdm(records, desc="retrieval heads", unit="context", disable=not progress):
            for message, sentence in calibration_prompts(record, rng, per_context):
                prompt = (tokenizer.apply_chat_template([{"role": "user", "content": message}], tokenize=False,
                                                        add_generation_prompt=True) if tokenizer.chat_template else message)
                encoded = tokenizer(prompt, return_offsets_mapping=True, add_special_tokens=False)
                ids = encoded.input_ids
                if len(ids) > max_tokens:
                    continue
                start = prompt.index(sentence)
                span = sentence_ids(ids, tokenizer, model.config.vocab_size)  # (S,)
                target = int(span[next(i for i, (_, end) in enumerate(encoded.offset_mapping) if end > start)])
                model(input_ids=torch.tensor([ids]), use_cache=False, logits_to_keep=1)
                received = recorder.take()  # (L, Hkv, S)
                context = (span >= int(span[4])) & (torch.arange(len(ids)) < len(ids) - 2 * query_window)  # no sinks, no question
                pooled = torch.full((*received.shape[:2], int(span.max()) + 1), float("-inf"))
                pooled = pooled.scatter_reduce(2, span[context].expand(*received.shape[:2], -1), received[..., context], "amax")
                better = (pooled > pooled[..., target : target + 1]).sum(dim=2)  # (L, Hkv) sentences ranked above it
                hits = (better < top).float() + (0 if hits is None else hits)
                asked += 1
    if not asked:
        raise ValueError(f"no calibration prompt fits in {max_tokens} tokens")
    return hits / asked, asked


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvpop_train.scorer.retrieval_heads", description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help="Hugging Face model directory")
    parser.add_argument("--texts", type=Path, required=True, help="contexts to plant facts in (kvpop_train.scorer.english_texts)")
    parser.add_argument("--out", type=Path, required=True, help=f"where to write {RETRIEVAL_HEADS_FILE}")
    parser.add_argument("--contexts", type=int, default=32)
    parser.add_argument("--per-context", type=int, default=2, help="prompts built from each context")
    parser.add_argument("--heads", type=int, default=4, help="how many heads to keep (4: chosen on the validation split, docs/QUALITY.md)")
    parser.add_argument("--query-window", type=int, default=32)
    parser.add_argument("--top", type=int, default=3, help="a hit: the asked sentence among the head's top this many")
    parser.add_argument("--max-tokens", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=0)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.time()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    records = [json.loads(line) for line in args.texts.read_text().splitlines() if line.strip()][: args.contexts]
    rates, asked = head_hit_rates(model, tokenizer, records, args.query_window, args.top, args.per_context, args.max_tokens)
    order = torch.argsort(rates.flatten(), descending=True)[: args.heads]
    heads = [[int(index) // rates.shape[1], int(index) % rates.shape[1]] for index in order]
    result = {
        "model": str(args.model), "texts": str(args.texts), "contexts": len(records), "questions": asked,
        "query_window": args.query_window, "top": args.top,
        "heads": heads,  # [layer, kv_head], best first
        "hit_rate": [round(float(rates[layer, head]), 4) for layer, head in heads],
        "hit_rate_all": [[round(float(rate), 4) for rate in row] for row in rates],  # (L, Hkv)
        "seconds": round(time.time() - started, 1),
    }
    out = args.out / RETRIEVAL_HEADS_FILE if args.out.suffix != ".json" else args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("{\n" + ",\n".join(f"  {json.dumps(key)}: {json.dumps(value)}" for key, value in result.items()) + "\n}\n")
    print(f"{asked} questions; retrieval heads (layer, kv head: hit rate): "
          + ", ".join(f"{layer}.{head}: {rate:.2f}" for (layer, head), rate in zip(heads, result["hit_rate"])) + f" -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
