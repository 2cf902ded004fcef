"""The service behind the Triton model: tokenizer + engine + request/response mapping, no Triton types.

Kept free of `triton_python_backend_utils` so it can be unit-tested and reused by other front ends;
`model_repository/kvpop_service/1/model.py` only adapts Triton requests to it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from kvpop.decoder import DecoderStep
from kvpop.engine import Engine, GenerationResult
from kvpop.serving.config import ServiceConfig
from kvpop.serving.request import InvalidRequestError, ParsedRequest, parse_request

TOKENIZER_DIRNAME = "tokenizer"


@dataclass(frozen=True)
class Placement:
    """Where this model instance runs: Triton gives one instance per GPU in config.pbtxt."""

    device: str  # "cpu" or "cuda"
    device_id: int = 0

    @classmethod
    def from_triton_args(cls, args: dict[str, Any]) -> "Placement":
        kind = str(args.get("model_instance_kind", "CPU")).upper()
        return cls("cuda" if kind == "GPU" else "cpu", int(args.get("model_instance_device_id", 0) or 0))


class KVpopService:
    def __init__(self, model_dir: Path, config: ServiceConfig, placement: Placement = Placement("cpu")):
        from transformers import AutoTokenizer

        self.config = config
        self.placement = placement
        self.decoder = DecoderStep(model_dir, placement.device, placement.device_id, threads=config.ort_threads or None)
        self.tokenizer = AutoTokenizer.from_pretrained(Path(model_dir) / TOKENIZER_DIRNAME)
        self.engine = Engine(
            self.decoder,
            tokenizer=self.tokenizer,
            max_batch_size=config.max_batch_size,
            prefill_chunk=config.prefill_chunk_tokens,
        )

    def parse(self, request_id: str, get_input: Callable[[str], np.ndarray | None], parameters: dict) -> ParsedRequest:
        return parse_request(request_id, get_input, parameters, self.tokenizer, self.decoder.spec.vocab_size, self.config)

    def generate(self, requests: list[ParsedRequest]) -> list[GenerationResult]:
        return self.engine.generate([request.generation for request in requests])

    def response_tensors(self, result: GenerationResult) -> dict[str, np.ndarray]:
        """Output tensors of one finished request, each with Triton's leading batch dimension of 1."""
        text = self.tokenizer.decode(result.output_ids, skip_special_tokens=True)
        return {
            "text_output": np.array([[text.encode("utf-8")]], dtype=np.object_),
            "output_ids": np.array([result.output_ids], dtype=np.int64),
            "finish_reason": np.array([[result.finish_reason.encode()]], dtype=np.object_),
            "num_input_tokens": np.array([[len(result.prompt_ids)]], dtype=np.int32),
            "num_output_tokens": np.array([[len(result.output_ids)]], dtype=np.int32),
            "kv_budget": np.array([[result.budget]], dtype=np.int32),
            "peak_kv_bytes": np.array([[result.peak_kv_bytes]], dtype=np.int64),
            "tokens_evicted": np.array([[result.tokens_evicted]], dtype=np.int64),
            "compression": np.array([[result.compression]], dtype=np.float32),
        }


__all__ = ["InvalidRequestError", "KVpopService", "Placement", "ServiceConfig"]
