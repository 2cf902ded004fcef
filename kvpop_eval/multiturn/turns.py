"""A chat's token ids turn by turn in the model's chat template, each turn's prompt continuing the previous
prompt and reply token for token: a session then always continues, as a client re-rendering its messages
would have it (SmolLM2's template renders a reply back to its own tokens)."""

from __future__ import annotations

from kvpop.serving.kvpop_engine.chat import render_chat


class TurnTokens:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        one = [{"role": "user", "content": "A"}, {"role": "assistant", "content": "B"}]
        closed = render_chat(one, tokenizer, add_generation_prompt=False)
        opened = render_chat([*one, {"role": "user", "content": "\x00"}], tokenizer)
        if not opened.startswith(closed):
            raise ValueError("the chat template renders an earlier turn differently once a turn follows")
        self.after_reply = closed[closed.rindex("B") + 1 :]  # e.g. "<|im_end|>\n"
        self.user_turn = opened[len(closed) :].split("\x00")  # text before and after a user turn's content
        self.eos = tokenizer.eos_token_id
        eos_text = tokenizer.decode([self.eos]) if self.eos is not None else ""
        self.after_eos = self.after_reply[len(eos_text) :] if eos_text and self.after_reply.startswith(eos_text) else self.after_reply

    def first(self, user: str, system: str | None = None) -> list[int]:
        """The first turn's prompt: `system` (None: the template's default) and `user`."""
        messages = [{"role": "system", "content": system}] * (system is not None) + [{"role": "user", "content": user}]
        text = render_chat(messages, self.tokenizer)
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def next(self, prompt_ids: list[int], output_ids: list[int], user: str) -> list[int]:
        reply = list(output_ids)
        if self.eos is not None and (not reply or reply[-1] != self.eos):
            reply.append(self.eos)  # a reply cut at its token limit is closed as the template closes one
        text = self.after_eos + self.user_turn[0] + user + self.user_turn[1]
        return list(prompt_ids) + reply + self.tokenizer(text, add_special_tokens=False).input_ids

    def planned(self, users: list[str], reply_tokens: int, answer_tokens: int, system: str | None = None) -> int:
        """A chat's tokens when every reply takes `reply_tokens`, the answer included: what a session's
        one budget is sized by."""
        ids = self.first(users[0], system)
        for user in users[1:]:
            ids = self.next(ids, [0] * reply_tokens, user)
        return len(ids) + answer_tokens
