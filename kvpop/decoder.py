"""The ONNX decoder step, run by onnxruntime: the only place the engine touches the model."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort

from kvpop.model_spec import ModelSpec


@dataclass
class StepOutput:
    logits: np.ndarray  # (B, T, V)
    new_key: np.ndarray  # (L, B, Hkv, T, D), RoPE applied
    new_value: np.ndarray  # (L, B, Hkv, T, D)
    attention: np.ndarray  # (L, B, Hq, T, S): what the new queries put on the cached slots
    chunk_attention: np.ndarray  # (L, B, Hq, T, T): what they put on each other (causal)


def execution_providers(device: str, device_id: int = 0) -> list:
    """onnxruntime providers for "cpu" or "cuda" (falls back to the CPU when CUDA is missing)."""
    if device == "cuda" and "CUDAExecutionProvider" in ort.get_available_providers():
        return [("CUDAExecutionProvider", {"device_id": device_id}), "CPUExecutionProvider"]
    return ["CPUExecutionProvider"]


class DecoderStep:
    """One forward step over an explicit slot cache (see export/decoder_step.py for the contract)."""

    def __init__(self, model_dir: Path, device: str = "cpu", device_id: int = 0, threads: int | None = None):
        self.model_dir = Path(model_dir)
        self.spec = ModelSpec.load(self.model_dir)
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        threads = threads or int(os.environ.get("KVPOP_ORT_THREADS", "0"))
        if threads:
            options.intra_op_num_threads = threads
        self.session = ort.InferenceSession(
            str(self.model_dir / self.spec.decoder_file),
            sess_options=options,
            providers=execution_providers(device, device_id),
        )
        self.dtype = np.dtype(self.spec.dtype)

    def empty_cache(self, batch: int = 1, slots: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Zeroed (past_key, past_value, slot_mask) for `batch` sequences of `slots` slots."""
        shape = (self.spec.num_layers, batch, self.spec.num_kv_heads, slots, self.spec.head_dim)
        return np.zeros(shape, self.dtype), np.zeros(shape, self.dtype), np.zeros((batch, slots), bool)

    def run(
        self,
        input_ids: np.ndarray,  # (B, T) int64
        position_ids: np.ndarray,  # (B, T) int64
        past_key: np.ndarray,  # (L, B, Hkv, S, D)
        past_value: np.ndarray,  # (L, B, Hkv, S, D)
        slot_mask: np.ndarray,  # (B, S) bool
    ) -> StepOutput:
        outputs = self.session.run(
            None,
            {
                "input_ids": np.ascontiguousarray(input_ids, dtype=np.int64),
                "position_ids": np.ascontiguousarray(position_ids, dtype=np.int64),
                "past_key": np.ascontiguousarray(past_key, dtype=self.dtype),
                "past_value": np.ascontiguousarray(past_value, dtype=self.dtype),
                "slot_mask": np.ascontiguousarray(slot_mask, dtype=bool),
            },
        )
        return StepOutput(*outputs)
