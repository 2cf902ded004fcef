"""Warm prefixes from the engine model's config: parsed, tokenized as requests are, and prefilled at load.

`warm_prefixes` (config.pbtxt parameter) is a JSON list; each item is a string, tokenized as raw
text (what a completion prompt begins with: `text_input` with `raw_prompt`, or on a model without a
chat template), or a list of chat messages, rendered by the model's chat template WITHOUT the
assistant's generation prompt: the system prompt or header that `messages` requests, and on an
instruction-tuned model plain `text_input` requests (sent as a user turn), begin with. SmolLM2's
template gives a conversation without a system message its default one, so
`[[{"role": "system", "content": "You are a helpful AI assistant named SmolLM, trained by Hugging
Face"}]]` is a prefix of every such request (21 tokens). A request's prompt reuses a prefix only
when its token ids start with the prefix's, so a text prefix should end where the tokenizer cuts
anyway (a newline, a template's end-of-turn token).

A snapshot belongs to one cache configuration (`kvpop.cache.prefix_cache`); each prefix is
prefilled for the configuration a request gets when it names only a policy (or nothing):
`default_policy` and the policies in `warm_prefix_policies`, a bounded one at `default_kv_budget`,
kvpop with the service's scorer. Requests that name another budget or a compression ratio miss.
"""

from __future__ import annotations

import json
from typing import Any

from kvpop.serving.kvpop_engine.chat import InvalidMessagesError, parse_messages, render_chat


def parse_warm_prefixes(text: str) -> list[str | list[dict[str, str]]]:
    """The `warm_prefixes` parameter as a list of strings and message lists; ValueError if malformed."""
    if not text.strip():
        return []
    try:
        items = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"parameter warm_prefixes is not valid JSON ({error.msg} at character {error.pos})") from None
    if not isinstance(items, list):
        raise ValueError("parameter warm_prefixes must be a JSON list of strings or message lists")
    prefixes: list[str | list[dict[str, str]]] = []
    for index, item in enumerate(items):
        if isinstance(item, str) and item.strip():
            prefixes.append(item)
            continue
        try:
            prefixes.append(parse_messages(item if isinstance(item, list) else None))
        except InvalidMessagesError as error:
            raise ValueError(f"parameter warm_prefixes[{index}] is neither a non-empty string nor messages: {error}") from None
    return prefixes


def prefix_token_ids(prefix: str | list[dict[str, str]], tokenizer: Any) -> list[int]:
    """The token ids a request's prompt must start with to reuse `prefix`."""
    text = prefix if isinstance(prefix, str) else render_chat(prefix, tokenizer, add_generation_prompt=False)
    return list(tokenizer(text).input_ids)


def warm_policies(default_policy: str, extra: str) -> list[str]:
    """`default_policy` first, then the comma-separated `warm_prefix_policies`, without repeats."""
    names = [default_policy, *(name.strip() for name in extra.split(",") if name.strip())]
    return list(dict.fromkeys(names))


__all__ = ["parse_warm_prefixes", "prefix_token_ids", "warm_policies"]
