"""Numerical parity of the exported decoder step against the Hugging Face model it came from.

Two checks, both in fp32 against the HF logits of one forward over the whole sequence:
  prefill: the whole prompt in one step with an empty cache (S = 0);
  decode:  a prefill, then one token at a time, every new key/value written to a RANDOM free slot of
           a cache large enough that nothing is evicted. This proves slot order does not matter.

The tolerance is relative to the logit scale (the largest |logit| of the reference): fp32 rounding
grows with depth and with the logits' magnitude, so an absolute bound that a 2-layer test model
meets with room to spare fails a 30-layer model whose logits are in the tens (SmolLM2-135M: 1.4e-4
absolute, ~1e-5 relative). The greedy token must also agree at every position, unless the reference's
top two logits are closer than the measured error (a tie that no fp32 implementation can settle).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import torch

from kvpop.decoder import DecoderStep

PARITY_TOLERANCE = 1e-4  # of the logit scale
# By the exported dtype: a float16 step rounds every weight and activation to ~3 decimal digits.
PARITY_TOLERANCES = {"float32": PARITY_TOLERANCE, "float16": 2e-2}


@dataclass
class ParityReport:
    prefill_max_abs_diff: float
    decode_max_abs_diff: float
    prompt_tokens: int
    decode_tokens: int
    logit_scale: float = 1.0  # max |logit| of the reference over every checked position
    top1_agreement: float = 1.0  # fraction of positions whose greedy token agrees
    top1_disagreements_beyond_ties: int = 0  # disagreements where the reference's margin exceeds the error
    tolerance: float = PARITY_TOLERANCE

    @property
    def prefill_relative_diff(self) -> float:
        return self.prefill_max_abs_diff / self.logit_scale

    @property
    def decode_relative_diff(self) -> float:
        return self.decode_max_abs_diff / self.logit_scale

    @property
    def passed(self) -> bool:
        relative = max(self.prefill_relative_diff, self.decode_relative_diff)
        return relative <= self.tolerance and self.top1_disagreements_beyond_ties == 0

    def as_dict(self) -> dict:
        return {
            **asdict(self),
            "prefill_relative_diff": self.prefill_relative_diff,
            "decode_relative_diff": self.decode_relative_diff,
            "passed": self.passed,
        }


def _top1_check(reference: np.ndarray, exported: np.ndarray, error: float) -> tuple[int, int]:
    """(agreeing positions, disagreements not explained by a tie) for (N, V) logits."""
    want, have = reference.argmax(-1), exported.argmax(-1)
    rows = np.arange(len(want))
    margin = reference[rows, want] - reference[rows, have]  # 0 where they agree
    return int((want == have).sum()), int((margin > 2 * error).sum())


def check_parity(
    causal_lm: torch.nn.Module,
    step: DecoderStep,
    prompt_tokens: int = 24,
    decode_tokens: int = 12,
    seed: int = 0,
    tolerance: float = PARITY_TOLERANCE,
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
    prefill_diff = float(np.abs(prefill.logits.astype(np.float32) - reference[:, :prompt_tokens]).max())

    # A cache with a slot for every token, filled in a shuffled order.
    past_key, past_value, slot_mask = step.empty_cache(slots=total)
    slot_order = rng.permutation(total)
    slots = slot_order[:prompt_tokens]
    past_key[:, 0, :, slots] = prefill.new_key[:, 0].transpose(2, 0, 1, 3)
    past_value[:, 0, :, slots] = prefill.new_value[:, 0].transpose(2, 0, 1, 3)
    slot_mask[0, slots] = True
    decode_diff = 0.0
    decode_logits = []
    for index in range(prompt_tokens, total):
        out = step.run(token_ids[:, index : index + 1], positions[:, index : index + 1], past_key, past_value, slot_mask)
        decode_diff = max(decode_diff, float(np.abs(out.logits[0, 0].astype(np.float32) - reference[0, index]).max()))
        decode_logits.append(out.logits[0, 0].astype(np.float32))
        slot = slot_order[index]
        past_key[:, 0, :, slot] = out.new_key[:, 0, :, 0]
        past_value[:, 0, :, slot] = out.new_value[:, 0, :, 0]
        slot_mask[0, slot] = True
    error = max(prefill_diff, decode_diff)
    agree_prefill, beyond_prefill = _top1_check(reference[0, :prompt_tokens], prefill.logits[0], error)
    agree_decode, beyond_decode = _top1_check(reference[0, prompt_tokens:], np.stack(decode_logits), error)
    return ParityReport(
        prefill_diff, decode_diff, prompt_tokens, decode_tokens,
        logit_scale=max(float(np.abs(reference).max()), 1e-6),
        top1_agreement=(agree_prefill + agree_decode) / total,
        top1_disagreements_beyond_ties=beyond_prefill + beyond_decode, tolerance=tolerance,
    )
