"""The `messages` input: validation, rendering by the chat template (or the fallback), request parsing."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvpop.serving.kvpop_engine.chat import FALLBACK_CHAT_TEMPLATE, InvalidMessagesError, parse_messages, render_chat
from kvpop.serving.kvpop_engine.config import ServiceConfig
from kvpop.serving.kvpop_engine.parse import InvalidRequestError, parse_request

CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def tokenizer():
    from export.tiny_model import build_tokenizer

    return build_tokenizer()  # no chat template of its own


def test_messages_are_validated_with_a_message_that_says_what_is_wrong():
    assert parse_messages(json.dumps(CHAT)) == CHAT
    assert parse_messages(json.dumps(CHAT).encode()) == CHAT
    for raw, match in [
        ("not json", "not valid JSON"),
        ("[]", "non-empty JSON list"),
        ('{"role": "user"}', "non-empty JSON list"),
        ('[{"role": "user"}]', r"messages\[0\] must be an object"),
        ('[{"role": "robot", "content": "x"}]', "not one of"),
        ('[{"role": "user", "content": "  "}]', "no content"),
        (b"\xff", "UTF-8"),
    ]:
        with pytest.raises(InvalidMessagesError, match=match):
            parse_messages(raw)


def test_a_model_without_a_chat_template_uses_the_fallback(tokenizer):
    assert not tokenizer.chat_template
    assert render_chat(CHAT, tokenizer) == "system: Be brief.\nuser: What is the capital of France?\nassistant:"
    assert tokenizer.apply_chat_template(CHAT, chat_template=FALLBACK_CHAT_TEMPLATE, tokenize=False,
                                         add_generation_prompt=True).endswith("assistant:")


def test_the_model_s_own_chat_template_is_used(tokenizer):
    tokenizer.chat_template = CHATML
    try:
        prompt = render_chat(CHAT, tokenizer)
    finally:
        tokenizer.chat_template = None
    assert prompt.startswith("<|im_start|>system\nBe brief.<|im_end|>\n") and prompt.endswith("<|im_start|>assistant\n")


def parse(tokenizer, **inputs):
    arrays = {name: np.array([[value]], dtype=object) for name, value in inputs.items()}
    return parse_request("r", arrays.get, {}, tokenizer, len(tokenizer), ServiceConfig())


def test_messages_become_the_rendered_prompt(tokenizer):
    chat = parse(tokenizer, messages=json.dumps(CHAT).encode())
    text = parse(tokenizer, text_input=render_chat(CHAT, tokenizer).encode())
    assert chat.generation.prompt_ids == text.generation.prompt_ids
    by_parameter = parse_request("r", lambda name: None, {"messages": json.dumps(CHAT)}, tokenizer, len(tokenizer), ServiceConfig())
    assert by_parameter.generation.prompt_ids == chat.generation.prompt_ids


def test_messages_exclude_the_other_prompt_inputs_and_bad_ones_are_invalid_requests(tokenizer):
    with pytest.raises(InvalidRequestError, match="exactly one of text_input, input_ids or messages"):
        parse(tokenizer, messages=json.dumps(CHAT).encode(), text_input=b"hello")
    with pytest.raises(InvalidRequestError, match="not valid JSON"):
        parse(tokenizer, messages=b"[{")


def test_text_input_is_the_user_turn_of_a_model_with_a_chat_template(tokenizer):
    """An instruction-tuned model ends a bare question at once, so its text_input goes through the
    chat template as one user message, unless the request asks for the raw prompt or the service is
    configured `text_input_chat: never`; a model without a template always gets the text as is."""
    question = "What is the capital of France?"
    raw_ids = tokenizer(question).input_ids
    assert parse(tokenizer, text_input=question.encode()).generation.prompt_ids == raw_ids  # no template
    tokenizer.chat_template = CHATML
    try:
        turn = tokenizer(render_chat([{"role": "user", "content": question}], tokenizer)).input_ids
        assert parse(tokenizer, text_input=question.encode()).generation.prompt_ids == turn
        by_parameter = parse_request("r", lambda name: None, {"text_input": question}, tokenizer, len(tokenizer), ServiceConfig())
        assert by_parameter.generation.prompt_ids == turn
        arrays = {"text_input": np.array([[question.encode()]], dtype=object)}
        for parameters, config in [({"raw_prompt": True}, ServiceConfig()), ({"raw_prompt": "true"}, ServiceConfig()),
                                   ({}, ServiceConfig(text_input_chat="never"))]:
            assert parse_request("r", arrays.get, parameters, tokenizer, len(tokenizer), config).generation.prompt_ids == raw_ids
        with pytest.raises(InvalidRequestError, match="raw_prompt must be a boolean"):
            parse_request("r", arrays.get, {"raw_prompt": 3}, tokenizer, len(tokenizer), ServiceConfig())
        with pytest.raises(InvalidRequestError, match="text_input is empty"):
            parse(tokenizer, text_input=b"   ")
        with pytest.raises(InvalidRequestError, match="UTF-8"):
            parse(tokenizer, text_input=b"\xff")
    finally:
        tokenizer.chat_template = None
    with pytest.raises(ValueError, match="text_input_chat"):
        ServiceConfig(text_input_chat="sometimes")
