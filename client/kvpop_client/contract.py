"""What the KVpop models accept and answer, as this client needs it.

A mirror of the server's declaration (kvpop.serving.contract): this package installs and runs without
the server's, so it keeps its own copy, and the server's test suite checks the two are equal.
"""

from __future__ import annotations

import numpy as np

# kvpop_engine's inputs, name -> Triton wire datatype (kvpop_service takes the same, but `stream`).
PROMPT_INPUTS: dict[str, str] = {"text_input": "BYTES", "messages": "BYTES", "input_ids": "INT32"}
OPTION_INPUTS: dict[str, str] = {
    "max_tokens": "INT32",
    "temperature": "FP32",
    "top_p": "FP32",
    "top_k": "INT32",
    "seed": "UINT64",
    "ignore_eos": "BOOL",
    "stream": "BOOL",
    "eviction_policy": "BYTES",
    "kv_budget": "INT32",
    "compression_ratio": "FP32",
    "session_id": "BYTES",  # keep the conversation's cache on the server between turns
    "session_close": "BOOL",  # the session's last turn: the server forgets it afterwards
    "exclude_input_in_output": "BOOL",
    "min_length": "INT32",
    "min_tokens": "INT32",
    "beam_width": "INT32",
    "repetition_penalty": "FP32",
    "presence_penalty": "FP32",
    "frequency_penalty": "FP32",
    "return_num_input_tokens": "BOOL",
    "return_num_output_tokens": "BOOL",
}
LIST_INPUTS: dict[str, str] = {"stop": "BYTES", "stop_words": "BYTES", "sampling_parameters": "BYTES",
                               "guided_decoding_guide_type": "BYTES", "guided_decoding_guide": "BYTES"}
OUTPUTS: dict[str, str] = {
    "text_output": "BYTES", "output_ids": "INT64", "finish_reason": "BYTES", "num_input_tokens": "INT32",
    "num_output_tokens": "INT32", "kv_budget": "INT32", "peak_kv_bytes": "INT64", "tokens_evicted": "INT64",
    "compression": "FP32", "tokens_reused": "INT32", "tokens_computed": "INT32",
}
NUMPY_DTYPES = {"BYTES": np.object_, "BOOL": np.bool_, "INT32": np.int32, "INT64": np.int64, "UINT64": np.uint64,
                "FP32": np.float32}

FINISH_REASONS = ("stop", "length", "cancelled")

# The tag that starts every KVpop error message, and the gRPC status it means. Triton's gRPC stream
# carries a model's error without its code, so the tag is how a streamed error keeps it.
ERROR_TAG_STATUS = {"invalid argument: ": "INVALID_ARGUMENT", "unavailable: ": "UNAVAILABLE", "internal: ": "INTERNAL"}
