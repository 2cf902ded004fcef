"""English chat prompts of an exact token count, for the service benchmarks of a real model.

Why not random token ids: a real model's time per token does not depend on the text, but a bounded
cache's does (its scorer, the question's pick and the sentence spans read the prompt), and a peer
that reuses a prompt's prefix must see what users send. The text is the Python language reference's
prose (kvpop_eval.english_tasks's haystack, training split: never the quality tasks' paragraphs),
shuffled per prompt by its seed, cut to length, and put in the model's chat template with an ask at
the end, so every prompt is exactly `tokens` ids and the same on every machine.
"""

from __future__ import annotations

import random
from functools import lru_cache
from pathlib import Path

from kvpop_eval.english_tasks import haystack_paragraphs

ASKS = (
    "Summarize the text above in a few sentences.",
    "What are the main rules the text above describes? Answer briefly.",
    "Explain the text above to a new programmer.",
    "List the key terms the text above defines.",
)
SPLIT = "train"  # the quality tasks are drawn from the validation and test splits' paragraphs
MARK = "\u2063KVPOP-CONTENT\u2063"  # where the user's content goes in the rendered chat template


@lru_cache(maxsize=4)
def load_tokenizer(directory: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(directory)


@lru_cache(maxsize=4)
def paragraph_ids(directory: str) -> tuple[list[int], ...]:
    """Every paragraph of the split as token ids (a blank line after each), tokenized once."""
    tokenizer = load_tokenizer(directory)
    return tuple(tokenizer(paragraph + "\n\n", add_special_tokens=False).input_ids for paragraph in haystack_paragraphs()[SPLIT])


def template_ids(tokenizer) -> tuple[list[int], list[int]]:
    """The chat template's ids before and after a user turn's content (with the assistant header)."""
    if not tokenizer.chat_template:
        return [], []
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": MARK}], tokenize=False, add_generation_prompt=True)
    before, after = rendered.split(MARK)
    encode = lambda text: tokenizer(text, add_special_tokens=False).input_ids  # noqa: E731
    return encode(before), encode(after)


def english_prompts(tokenizer_dir: Path, count: int, tokens: int, seed: int) -> list[list[int]]:
    """`count` chat prompts of exactly `tokens` ids: prose cut to length, then one of ASKS."""
    tokenizer = load_tokenizer(str(tokenizer_dir))
    before, after = template_ids(tokenizer)
    paragraphs = paragraph_ids(str(tokenizer_dir))
    rng = random.Random(f"bench:{seed}:{tokens}")
    prompts = []
    for _ in range(count):
        ask = tokenizer("\n\n" + rng.choice(ASKS), add_special_tokens=False).input_ids
        room = tokens - len(before) - len(after) - len(ask)
        if room < 1:
            raise ValueError(f"{tokens} tokens leave no room for text beside the chat template and the ask")
        body: list[int] = []
        for index in rng.sample(range(len(paragraphs)), len(paragraphs)):
            body += paragraphs[index]
            if len(body) >= room:
                break
        prompts.append(before + body[:room] + ask + after)
    return prompts
