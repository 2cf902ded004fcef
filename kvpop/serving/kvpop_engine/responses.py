"""One response's output tensors, as the I/O contract declares them (`kvpop.serving.contract.OUTPUTS`)."""

from __future__ import annotations

import numpy as np

from kvpop.request import GenerationResult
from kvpop.serving.contract import OUTPUTS


def output_tensors(
    text: str,
    output_ids: list[int],
    finish_reason: str | None,
    num_input_tokens: int,
    num_output_tokens: int,
    result: GenerationResult | None = None,
) -> dict[str, np.ndarray]:
    """One response's tensors as kvpop.serving.contract.OUTPUTS declares them, each with Triton's
    leading batch dimension of 1: (1, 1), output_ids (1, N).

    A streamed token's response (no `finish_reason` yet) carries the `streamed` outputs only (text,
    token, counts); the cache statistics come with the last response (zeros if the request never
    started). Why: every tensor is built here, copied through the Python backend's shared memory and
    encoded by the front end once per token per stream; eight constant tensors per token were most of it.
    """
    values = {
        "text_output": text.encode("utf-8"),
        "output_ids": output_ids,
        "finish_reason": (finish_reason or "").encode(),
        "num_input_tokens": num_input_tokens,
        "num_output_tokens": num_output_tokens,
    }
    if finish_reason is not None:
        values.update({
            "kv_budget": result.budget if result else 0,
            "peak_kv_bytes": result.peak_kv_bytes if result else 0,
            "tokens_evicted": result.tokens_evicted if result else 0,
            "compression": result.compression if result else 0.0,
            "tokens_reused": result.tokens_reused if result else 0,
            "tokens_computed": num_input_tokens - result.tokens_reused if result else 0,
        })
    return {
        spec.name: np.array(values[spec.name], dtype=spec.numpy_dtype).reshape(1, -1)
        for spec in OUTPUTS if spec.streamed or finish_reason is not None
    }
