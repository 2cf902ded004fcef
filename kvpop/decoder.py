"""The ONNX decoder step, run by onnxruntime: the only place the engine touches the model."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort

from kvpop.cache.device_store import SLOT_WRITER_FILE, DeviceKVStore
from kvpop.model_spec import ModelSpec

# Where export writes the lean step variants (export/step_variants.py; kept in sync with it).
LEAN_SUFFIX, ATTENTION_SUFFIX = ".last.onnx", ".last_attention.onnx"


def variant_paths(decoder_path: Path) -> dict[str, Path]:
    stem = str(Path(decoder_path).with_suffix(""))
    return {"lean": Path(stem + LEAN_SUFFIX), "attention": Path(stem + ATTENTION_SUFFIX)}


@dataclass
class StepOutput:
    logits: np.ndarray  # (B, T, V); (B, 1, V) from a last-position step
    new_key: np.ndarray  # (L, B, Hkv, T, D), RoPE applied
    new_value: np.ndarray  # (L, B, Hkv, T, D)
    attention: np.ndarray | None = None  # (L, B, Hq, T, S): what the new queries put on the cached slots
    chunk_attention: np.ndarray | None = None  # (L, B, Hq, T, T): what they put on each other (causal)


def execution_providers(device: str, device_id: int = 0) -> list:
    """onnxruntime providers for "cpu" or "cuda" (falls back to the CPU when CUDA is missing)."""
    if device == "cuda" and "CUDAExecutionProvider" in ort.get_available_providers():
        return [("CUDAExecutionProvider", {"device_id": device_id}), "CPUExecutionProvider"]
    return ["CPUExecutionProvider"]


class DecoderStep:
    """One forward step over an explicit slot cache (see export/decoder_step.py for the contract).

    `run(..., last_only=True, attention=False)` takes the lean variants export wrote beside the step
    (export/step_variants.py: last-position logits; attention only when asked), the serving hot path.
    An export without them falls back to the full step (same values, more work).

    `resident`: keep the batch pool's cache in the decoder's device memory between steps (IO binding,
    kvpop.cache.device_store). Default: on when the CUDA provider runs the step; "cpu" works too. The
    decoder builds the `device_store` (it knows its provider and device); the engine's cache manager
    keeps it in sync with the batch pool and hands `run` its device arrays.
    """

    def __init__(
        self,
        model_dir: Path,
        device: str = "cpu",
        device_id: int = 0,
        threads: int | None = None,
        resident: bool | None = None,
    ):
        self.model_dir = Path(model_dir)
        self.spec = ModelSpec.load(self.model_dir)
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        threads = threads or int(os.environ.get("KVPOP_ORT_THREADS", "0"))
        if threads:
            options.intra_op_num_threads = threads
        providers = execution_providers(device, device_id)
        self._options, self._providers = options, providers
        # (last_only, attention) -> graph file; the full step answers whatever has no variant. Each
        # session holds its own copy of the weights (onnxruntime folds and prepacks them per session),
        # so a session is loaded on first use: the lean one now, the attention variant when a policy
        # that reads attention first runs, the full step only for callers that want every position.
        decoder_path = self.model_dir / self.spec.decoder_file
        variants = variant_paths(decoder_path)
        self._files = {(False, True): decoder_path}
        if variants["lean"].exists() and variants["attention"].exists():
            self._files[(True, False)], self._files[(True, True)] = variants["lean"], variants["attention"]
        self._sessions: dict[tuple[bool, bool], ort.InferenceSession] = {}
        first = self._load((True, False) if self.has_lean_variants else (False, True))
        self.dtype = np.dtype(self.spec.dtype)
        on_cuda = "CUDAExecutionProvider" in first.get_providers()
        self.device_store: DeviceKVStore | None = None
        if resident or (resident is None and on_cuda and (self.model_dir / SLOT_WRITER_FILE).exists()):
            self.device_store = DeviceKVStore(self.model_dir, "cuda" if on_cuda else "cpu", device_id, providers)

    def _load(self, key: tuple[bool, bool]) -> ort.InferenceSession:
        if key not in self._sessions:
            self._sessions[key] = ort.InferenceSession(str(self._files[key]), sess_options=self._options, providers=self._providers)
        return self._sessions[key]

    @property
    def session(self) -> ort.InferenceSession:
        """The full exported step (every position's logits, attention)."""
        return self._load((False, True))

    @property
    def has_lean_variants(self) -> bool:
        return (True, False) in self._files

    def _session(self, last_only: bool, attention: bool) -> ort.InferenceSession:
        if not last_only or not self.has_lean_variants:
            return self.session
        return self._load((True, attention))

    def empty_cache(self, batch: int = 1, slots: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Zeroed (past_key, past_value, slot_mask) for `batch` sequences of `slots` slots."""
        shape = (self.spec.num_layers, batch, self.spec.num_kv_heads, slots, self.spec.head_dim)
        return np.zeros(shape, self.dtype), np.zeros(shape, self.dtype), np.zeros((batch, slots), bool)

    def run(
        self,
        input_ids: np.ndarray,  # (B, T) int64
        position_ids: np.ndarray,  # (B, T) int64
        past_key: np.ndarray | ort.OrtValue,  # (L, B, Hkv, S, D); an OrtValue: the device-resident pool
        past_value: np.ndarray | ort.OrtValue,  # (L, B, Hkv, S, D)
        slot_mask: np.ndarray,  # (B, S) bool
        last_only: bool = False,
        attention: bool = True,
    ) -> StepOutput:
        """`last_only`: logits of the last new position only (B, 1, V); `attention`: False allows a
        step that returns no attention (None), for policies that never read it."""
        session = self._session(last_only, attention)
        if isinstance(past_key, ort.OrtValue):
            return self._run_bound(session, input_ids, position_ids, past_key, past_value, slot_mask, last_only)
        outputs = session.run(
            None,
            {
                "input_ids": np.ascontiguousarray(input_ids, dtype=np.int64),
                "position_ids": np.ascontiguousarray(position_ids, dtype=np.int64),
                "past_key": np.ascontiguousarray(past_key, dtype=self.dtype),
                "past_value": np.ascontiguousarray(past_value, dtype=self.dtype),
                "slot_mask": np.ascontiguousarray(slot_mask, dtype=bool),
            },
        )
        return self._output(session, outputs, last_only)

    @staticmethod
    def _output(session: ort.InferenceSession, outputs: list[np.ndarray], last_only: bool) -> StepOutput:
        named = dict(zip((output.name for output in session.get_outputs()), outputs))
        if last_only and named["logits"].shape[1] != 1:
            named["logits"] = named["logits"][:, -1:]
        return StepOutput(**named)

    def _run_bound(
        self,
        session: ort.InferenceSession,
        input_ids: np.ndarray,
        position_ids: np.ndarray,
        key: ort.OrtValue,
        value: ort.OrtValue,
        slot_mask: np.ndarray,
        last_only: bool,
    ) -> StepOutput:
        """A step over a cache already in device memory (IO binding: the cache is not copied)."""
        binding = session.io_binding()
        binding.bind_cpu_input("input_ids", np.ascontiguousarray(input_ids, dtype=np.int64))
        binding.bind_cpu_input("position_ids", np.ascontiguousarray(position_ids, dtype=np.int64))
        binding.bind_ortvalue_input("past_key", key)
        binding.bind_ortvalue_input("past_value", value)
        binding.bind_cpu_input("slot_mask", np.ascontiguousarray(slot_mask, dtype=bool))
        for output in session.get_outputs():  # small: logits, the new tokens' k/v, attention rows
            binding.bind_output(output.name, "cpu")
        session.run_with_iobinding(binding)
        return self._output(session, binding.copy_outputs_to_cpu(), last_only)
