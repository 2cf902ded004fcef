"""A request's prompt: exactly one of the contract's prompt inputs (text_input, input_ids, messages), a chat
rendered by the model's chat template, a plain text the user turn of a chat model, then tokenized and bounded."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from kvpop.serving import contract
from kvpop.serving.errors import InvalidRequestError
from kvpop.serving.kvpop_engine.config import ServiceConfig


def decode_utf8(value: Any, name: str) -> str:
    if isinstance(value, (bytes, np.bytes_)):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError as error:
            raise InvalidRequestError(f"{name} is not valid UTF-8 ({error.reason} at byte {error.start})") from None
    if isinstance(value, str):
        if not contract.encodable(value):
            raise InvalidRequestError(f"{name} is not valid UTF-8 text (it holds a lone surrogate)")
        return value
    raise InvalidRequestError(f"{name} must be BYTES (a UTF-8 string), got {type(value).__name__}")


def chat_prompt(get_input: Callable[[str], np.ndarray | None], parameters: dict[str, Any], tokenizer) -> np.ndarray | None:
    """The `messages` input (one BYTES element of JSON, or a request parameter) rendered by the model's
    chat template, as a `text_input` tensor; None when the request has no messages."""
    from kvpop.serving.kvpop_engine.chat import InvalidMessagesError, parse_messages, render_chat

    tensor = get_input("messages")
    if tensor is None and "messages" not in parameters:
        return None
    if tensor is not None and tensor.size == 1 and blank(decode_utf8(tensor.reshape(-1)[0], "messages")):
        return None  # an empty messages input (perf_analyzer's zero data) is not sent
    if tensor is not None and tensor.size != 1:
        raise InvalidRequestError(f"messages must hold exactly one JSON string, got shape {list(tensor.shape)}")
    raw = tensor.reshape(-1)[0] if tensor is not None else parameters["messages"]
    try:
        return np.array([render_chat(parse_messages(raw), tokenizer)], dtype=object)
    except InvalidMessagesError as error:
        raise InvalidRequestError(str(error)) from None


def _text_as_user_turn(parameters: dict[str, Any], tokenizer, config: ServiceConfig) -> bool:
    """Whether a `text_input` goes through the model's chat template as one user message
    (kvpop.serving.kvpop_engine.config.TEXT_INPUT_CHAT says why)."""
    raw = parameters.get("raw_prompt", False)
    if isinstance(raw, str):
        raw = raw.strip().lower() in ("1", "true", "yes")
    elif not isinstance(raw, bool):
        raise InvalidRequestError(f"parameter raw_prompt must be a boolean, got {raw!r}")
    return not raw and config.text_input_chat == "auto" and bool(getattr(tokenizer, "chat_template", None))


def _user_turn(text: np.ndarray, tokenizer) -> np.ndarray:
    """A non-empty text_input (one string) as the prompt of a one-message chat; anything else as is,
    for the checks below to refuse."""
    from kvpop.serving.kvpop_engine.chat import render_chat

    if text.size != 1 or not _non_empty_text(text):
        return text
    prompt = decode_utf8(text.reshape(-1)[0], "text_input")
    if _is_rendered_chat(prompt, tokenizer):
        return text
    return np.array([render_chat([{"role": "user", "content": prompt}], tokenizer)], dtype=object)


def _is_rendered_chat(prompt: str, tokenizer) -> bool:
    """Whether a text_input already holds the chat template's turn markers (e.g. SmolLM2's
    `<|im_start|>`): a client that rendered the template itself (Triton's OpenAI frontend does) sent a
    finished prompt, which wrapping again would turn into a user message quoting a chat."""
    markers = getattr(tokenizer, "additional_special_tokens", None) or getattr(tokenizer, "all_special_tokens", [])
    return any(len(marker) > 1 and marker in prompt for marker in markers)


def _prompt_input(get_input: Callable[[str], np.ndarray | None], parameters: dict[str, Any], tokenizer,
                  config: ServiceConfig) -> tuple[np.ndarray | None, np.ndarray | None]:
    """(text, ids): exactly one of the contract's prompt inputs, a chat rendered as text."""
    text = get_input("text_input")
    ids = get_input("input_ids")
    if text is None and "text_input" in parameters:
        text = np.array([parameters["text_input"]], dtype=object)
    chat = chat_prompt(get_input, parameters, tokenizer)
    if chat is None and text is not None and _text_as_user_turn(parameters, tokenizer, config):
        text = _user_turn(text, tokenizer)
    if chat is not None:
        if text is not None or ids is not None:
            raise InvalidRequestError("send exactly one of text_input, input_ids or messages")
        text = chat
    if text is not None and ids is not None:
        # perf_analyzer fills every optional input: a non-empty text_input wins over input_ids;
        # an empty text_input gives way to them.
        if _non_empty_text(text):
            ids = None
        else:
            text = None
    if (text is None) == (ids is None):
        raise InvalidRequestError(
            f"send exactly one of text_input ({_wire('text_input')}) or input_ids ({_wire('input_ids')} [1, N])")
    return text, ids


def read_prompt(get_input: Callable[[str], np.ndarray | None], parameters: dict[str, Any], tokenizer, vocab_size: int,
                config: ServiceConfig) -> list[int]:
    """The prompt's token ids: its text tokenized, or its ids checked against the vocabulary."""
    text, ids = _prompt_input(get_input, parameters, tokenizer, config)
    if text is not None:
        if text.size != 1:
            raise InvalidRequestError(f"text_input must hold exactly one string, got shape {list(text.shape)}")
        prompt = decode_utf8(text.reshape(-1)[0], "text_input")
        if not prompt.strip():
            raise InvalidRequestError("text_input is empty")
        if len(prompt) > config.max_prompt_tokens * 32:  # refuse absurd payloads before tokenizing
            raise InvalidRequestError(f"text_input is too long ({len(prompt)} characters)")
        prompt_ids = list(tokenizer(prompt).input_ids)
    else:
        if not np.issubdtype(ids.dtype, np.integer):
            raise InvalidRequestError(f"input_ids must be INT32 or INT64, got {ids.dtype}")
        if ids.size > config.max_prompt_tokens:  # refuse before converting a huge payload
            raise InvalidRequestError(
                f"prompt has {ids.size} tokens; this service accepts at most {config.max_prompt_tokens}"
            )
        prompt_ids = [int(token) for token in ids.reshape(-1)]
        if not prompt_ids:
            raise InvalidRequestError("input_ids is empty")
        bad = [token for token in prompt_ids if not 0 <= token < vocab_size]
        if bad:
            raise InvalidRequestError(f"input_ids out of range [0, {vocab_size}): {bad[:5]}")
    if not prompt_ids:
        raise InvalidRequestError("the prompt is empty after tokenization")
    if len(prompt_ids) > config.max_prompt_tokens:
        raise InvalidRequestError(
            f"prompt has {len(prompt_ids)} tokens; this service accepts at most {config.max_prompt_tokens}"
        )
    return prompt_ids


def _wire(name: str) -> str:
    return contract.ENGINE.input(name).datatype


def _non_empty_text(text: np.ndarray) -> bool:
    return text.size == 1 and not blank(decode_utf8(text.reshape(-1)[0], "text_input"))


def blank(value: str) -> bool:
    """Empty, whitespace or NUL only: perf_analyzer's zero data for strings."""
    return not value.strip(" \t\r\n\x00")
