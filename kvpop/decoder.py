"""The ONNX decoder step, run by onnxruntime: the only place the engine touches the model."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import onnxruntime as ort

from kvpop.device_store import SLOT_WRITER_FILE, DeviceKVStore
from kvpop.model_spec import ModelSpec

# Where export writes the lean step variants (export/step_variants.py; kept in sync with it).
LEAN_SUFFIX, ATTENTION_SUFFIX = ".last.onnx", ".last_attention.onnx"
MIXED_SUFFIX = ".mixed.onnx"  # export/onnx_export.py: a decode batch and prompt pieces in one call


def variant_paths(decoder_path: Path) -> dict[str, Path]:
    stem = str(Path(decoder_path).with_suffix(""))
    return {"lean": Path(stem + LEAN_SUFFIX), "attention": Path(stem + ATTENTION_SUFFIX)}


def mixed_step_path(decoder_path: Path) -> Path:
    return Path(str(Path(decoder_path).with_suffix("")) + MIXED_SUFFIX)


CACHE_INPUTS = ("past_key", "past_value")


def step_input_names(num_layers: int, prefix: str = "") -> list[str]:
    """The step graph's inputs, in order. The cache comes one tensor per layer (`past_key.0` ...
    `past_key.{L-1}`, each (B, Hkv, S, D)): a layer that read its slice of one (L, B, Hkv, S, D)
    input would make onnxruntime copy the whole cache into per-layer tensors on every step (a Split,
    a large share of a long full cache's decode step), while the slices of the host's (L, ...) arrays
    go in as they are."""
    names = ["input_ids", "position_ids", *(f"{cache}.{layer}" for cache in CACHE_INPUTS for layer in range(num_layers)),
             "slot_mask"]
    return [prefix + name for name in names]


def split_caches(feed: dict, prefix: str = "") -> dict:
    """`feed` (a step's inputs by name) with each whole cache array, (L, B, Hkv, S, D), replaced by its
    per-layer inputs: views of it, not copies."""
    split = {}
    for name, value in feed.items():
        if name.removeprefix(prefix) in CACHE_INPUTS:
            split.update({f"{name}.{layer}": layer_value for layer, layer_value in enumerate(value)})
        else:
            split[name] = value
    return split


class StepInputs(NamedTuple):
    """One segment of a decoder call: B sequences' T new tokens over their own caches."""

    input_ids: np.ndarray  # (B, T) int64
    position_ids: np.ndarray  # (B, T) int64
    past_key: "np.ndarray | ort.OrtValue"  # (L, B, Hkv, S, D); an OrtValue: the device-resident pool
    past_value: "np.ndarray | ort.OrtValue"  # (L, B, Hkv, S, D)
    slot_mask: np.ndarray  # (B, S) bool


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
    `run_mixed(decode, prompt)` runs a decode batch and prompt pieces in one call (the mixed step,
    export/onnx_export.py: the weights are read once for both); with it, lean calls run through it too
    (an empty segment beside), so the lean graph's session, another copy of the weights, is never built.

    `mixed=False` ignores the mixed step (every call separate, as before it existed: for comparisons).

    `resident`: keep the batch pool's cache in the decoder's device memory between steps (IO binding,
    kvpop.device_store). Default: on when the CUDA provider runs the step; "cpu" works too. The
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
        mixed: bool = True,
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
        self._mixed_file = mixed_step_path(decoder_path) if mixed else None  # mixed=False: separate calls (A/B)
        self._mixed: ort.InferenceSession | None = None
        self._sessions: dict[tuple[bool, bool], ort.InferenceSession] = {}
        if self._mixed_file is not None and self._mixed_file.exists():
            self._mixed = ort.InferenceSession(str(self._mixed_file), sess_options=options, providers=providers)
            first = self._mixed
        else:
            first = self._load((True, False) if self.has_lean_variants else (False, True))
        self.dtype = np.dtype(self.spec.dtype)
        if "past_key" in {graph_input.name.removeprefix("decode_") for graph_input in first.get_inputs()}:
            raise RuntimeError(f"{self.model_dir} holds a decoder step whose cache is one input for every layer "
                               "(an older export): run `make export` again")
        self._device_id = device_id
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

    @property
    def has_mixed_step(self) -> bool:
        """Whether the export has the mixed decode + prompt step (`run_mixed`)."""
        return self._mixed is not None  # loaded at init when exported (asked every engine step: no stat)

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
        inputs = StepInputs(input_ids, position_ids, past_key, past_value, slot_mask)
        if last_only and not attention and self._mixed is not None:
            if input_ids.shape[1] == 1:  # the decode segment, whose T = 1 is static in the graph
                return self.run_mixed(inputs, self._empty_segment())[0]
            return self.run_mixed(self._empty_segment(), inputs)[1]
        session = self._session(last_only, attention)
        outputs = self._run(session, self._feed(inputs))
        named = dict(zip((output.name for output in session.get_outputs()), outputs))
        if last_only and named["logits"].shape[1] != 1:
            named["logits"] = named["logits"][:, -1:]
        return StepOutput(**named)

    def run_mixed(self, decode: StepInputs, prompt: StepInputs) -> tuple[StepOutput, StepOutput]:
        """One call for a decode batch (T = 1) and prompt pieces of other sequences (T tokens each):
        last-position logits and new keys/values of each, no attention. Either may be empty (B = 0)."""
        if self._mixed is None:
            raise RuntimeError(f"no mixed step for {self.model_dir} (not exported, or mixed=False)")
        feed = {f"decode_{name}": value for name, value in self._feed(decode).items()}
        feed.update({f"prompt_{name}": value for name, value in self._feed(prompt).items()})
        decode_logits, decode_key, decode_value, prompt_logits, prompt_key, prompt_value = self._run(self._mixed, feed)
        return StepOutput(decode_logits, decode_key, decode_value), StepOutput(prompt_logits, prompt_key, prompt_value)

    def _empty_segment(self) -> StepInputs:
        """A segment of no sequences (B = 0), beside a mixed call's only real one."""
        past_key, past_value, slot_mask = self.empty_cache(batch=0)
        nothing = np.zeros((0, 1), np.int64)
        return StepInputs(nothing, nothing, past_key, past_value, slot_mask)

    def _feed(self, inputs: StepInputs) -> dict[str, "np.ndarray | tuple[ort.OrtValue, int]"]:
        """A segment as the graph's inputs: contiguous arrays of its dtypes, the caches' per-layer slices
        as views of them (a device-resident cache as (OrtValue, layer): bound in place by `_run`)."""
        dtypes = {"input_ids": np.int64, "position_ids": np.int64, "slot_mask": bool}
        feed: dict[str, "np.ndarray | tuple[ort.OrtValue, int]"] = {
            name: np.ascontiguousarray(getattr(inputs, name), dtype=dtype) for name, dtype in dtypes.items()
        }
        for name in CACHE_INPUTS:
            cache = getattr(inputs, name)  # (L, B, Hkv, S, D)
            if isinstance(cache, ort.OrtValue):
                feed.update({f"{name}.{layer}": (cache, layer) for layer in range(self.spec.num_layers)})
            else:
                feed[name] = np.ascontiguousarray(cache, dtype=self.dtype)
        return split_caches(feed)

    def _run(self, session: ort.InferenceSession, feed: dict[str, "np.ndarray | tuple[ort.OrtValue, int]"]) -> list[np.ndarray]:
        """Run `session`; a cache already in device memory is bound in place, each layer at its offset in
        the (L, B, Hkv, S, D) pool (IO binding: not copied)."""
        if not any(isinstance(value, tuple) for value in feed.values()):
            return session.run(None, feed)
        binding = session.io_binding()
        for name, value in feed.items():
            if isinstance(value, tuple):
                pool, layer = value
                shape = pool.shape()[1:]  # (B, Hkv, S, D)
                layer_bytes = pool.tensor_size_in_bytes() // pool.shape()[0]
                binding.bind_input(name, pool.device_name(), self._device_id, pool.element_type(), shape,
                                   pool.data_ptr() + layer * layer_bytes)
            else:
                binding.bind_cpu_input(name, value)
        for output in session.get_outputs():  # small: logits, the new tokens' k/v, attention rows
            binding.bind_output(output.name, "cpu")
        session.run_with_iobinding(binding)
        return binding.copy_outputs_to_cpu()
