"""The `messages` input: a chat (JSON list of {role, content}) rendered into a prompt by the model's
chat template.

A model whose tokenizer has no chat template (the reference model, the tiny test model) uses
`FALLBACK_CHAT_TEMPLATE`: one "role: content" line per message and "assistant:" to answer after.
The rendered prompt then takes the same path as `text_input`; the model's end-of-sequence token
(SmolLM2's `<|im_end|>`, the end of the assistant's turn) ends generation as for any prompt.
"""

from __future__ import annotations

import json
from typing import Any

from kvpop.serving.contract import unencodable_at

MAX_MESSAGES = 256
ROLES = ("system", "user", "assistant", "tool")
FALLBACK_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


class InvalidMessagesError(ValueError):
    """The messages are malformed; the message says how."""


def parse_messages(raw: Any) -> list[dict[str, str]]:
    """Validate a chat given as JSON text (or an already decoded list)."""
    if isinstance(raw, (bytes, bytearray)):
        try:
            raw = bytes(raw).decode("utf-8")
        except UnicodeDecodeError:
            raise InvalidMessagesError("messages is not valid UTF-8") from None
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as error:
            raise InvalidMessagesError(f"messages is not valid JSON ({error.msg} at character {error.pos})") from None
        except RecursionError:
            raise InvalidMessagesError("messages nests too deeply") from None
    where = unencodable_at(raw)
    if where is not None:
        raise InvalidMessagesError(f"messages.{where} is not valid UTF-8 text (it holds a lone surrogate)")
    if not isinstance(raw, list) or not raw:
        raise InvalidMessagesError('messages must be a non-empty JSON list of {"role": ..., "content": ...}')
    if len(raw) > MAX_MESSAGES:
        raise InvalidMessagesError(f"messages holds {len(raw)} messages; at most {MAX_MESSAGES}")
    messages = []
    for index, message in enumerate(raw):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) or not isinstance(message.get("content"), str):
            raise InvalidMessagesError(f"messages[{index}] must be an object with string fields role and content")
        if message["role"] not in ROLES:
            raise InvalidMessagesError(f"messages[{index}].role {message['role']!r} is not one of {list(ROLES)}")
        messages.append({"role": message["role"], "content": message["content"]})
    if not any(message["content"].strip() for message in messages):
        raise InvalidMessagesError("messages has no content")
    return messages


def render_chat(messages: list[dict[str, str]], tokenizer, add_generation_prompt: bool = True) -> str:
    """The prompt text for `messages`, ending where the assistant's answer starts (or, without the
    generation prompt, where the next message would: a warm prefix)."""
    template = None if getattr(tokenizer, "chat_template", None) else FALLBACK_CHAT_TEMPLATE
    try:
        return tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False, add_generation_prompt=add_generation_prompt)
    except Exception as error:  # a template may refuse a conversation (e.g. roles out of order)
        raise InvalidMessagesError(f"the model's chat template refused these messages: {error}") from None
