"""Numerical parity of the exported decoder step against the Hugging Face model it came from.

Two checks, both in fp32 against the HF logits of one forward over the whole sequence:
  prefill: the whole prompt in one step with an empty cache (S = 0);
  decode:  a prefill, then one token at a time, every new key/value written to a RANDOM free slot of
           a cache large enough that nothing is evicted. This proves slot order does not matter.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import torch

from kvpop.decoder import DecoderStep

PARITY_TOLERANCE = 1e-4


@dataclass
class ParityReport:
    prefill_max_abs_diff: float
    decode_max_abs_diff: float
    prompt_tokens: int
    decode_tokens: int
    tolerance: float = PARITY_TOLERANCE

    @property
    def passed(self) -> bool:
        return max(self.prefill_max_abs_diff, self.decode_max_abs_diff) <= self.tolerance

    def as_dict(self) -> dict:
        return {**asdict(self), "passed": self.passed}


def check_parity(
    causal_lm: torch.nn.Module,
    step: DecoderStep,
    prompt_tokens: int = 24,
    decode_tokens: int = 12,
    seed: int = 0,
) -> ParityReport:
    rng = np.random.default_rng(seed)
    total = prompt_tokens + decode_tokens
    vocab = step.spec.vocab_size
    token_ids = rng.integers(0, vocab, size=(1, total), dtype=np.int64)
    with torch.no_grad():
        reference = causal_lm(torch.from_numpy(token_ids)).logits.float().numpy()  # (1, total, V)

    positions = np.arange(total, dtype=np.int64)[None]
    key, value, mask = step.empty_cache()
    prefill = step.run(token_ids[:, :prompt_tokens], positions[:, :prompt_tokens], key, value, mask)
    prefill_diff = float(np.abs(prefill.logits - reference[:, :prompt_tokens]).max())

    # A cache with a slot for every token, filled in a shuffled order.
    past_key, past_value, slot_mask = step.empty_cache(slots=total)
    slot_order = rng.permutation(total)
    slots = slot_order[:prompt_tokens]
    past_key[:, 0, :, slots] = prefill.new_key[:, 0].transpose(2, 0, 1, 3)
    past_value[:, 0, :, slots] = prefill.new_value[:, 0].transpose(2, 0, 1, 3)
    slot_mask[0, slots] = True
    decode_diff = 0.0
    for index in range(prompt_tokens, total):
        out = step.run(token_ids[:, index : index + 1], positions[:, index : index + 1], past_key, past_value, slot_mask)
        decode_diff = max(decode_diff, float(np.abs(out.logits[0, 0] - reference[0, index]).max()))
        slot = slot_order[index]
        past_key[:, 0, :, slot] = out.new_key[:, 0, :, 0]
        past_value[:, 0, :, slot] = out.new_value[:, 0, :, 0]
        slot_mask[0, slot] = True
    return ParityReport(prefill_diff, decode_diff, prompt_tokens, decode_tokens)
