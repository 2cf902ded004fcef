"""The batch pool's keys and values, resident on the decoder's device between steps.

Why: with the CUDA execution provider, handing the decoder numpy arrays copies the whole cache to
the GPU on every step (2 * L * B * Hkv * S * D numbers per token). Here the cache lives in device
memory as onnxruntime OrtValues bound to the decoder through IO binding. The host pool stays the
source of truth for the eviction policies (which read slot metadata and leaving tokens on the CPU);
after each step only the slots the host wrote are scattered into the device copy by the slot-writer
graph (export/slot_writer.py), so a steady-state decode step moves O(new tokens), not O(cache).
The whole pool is uploaded only when its membership or shape changes (`BatchSlotPool.repacks`).
Prefill still hands the decoder its one sequence's cache as host arrays: one copy of at most `budget`
slots per prompt chunk, spread over the chunk's tokens.

The same code runs with device "cpu" (OrtValues in host memory), which is how it is tested on
machines without a GPU.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort

SLOT_WRITER_FILE = "slot_writer.onnx"  # written beside the decoder by `make export`
SLOT_AXIS = 3  # the slot axis of (L, B, Hkv, S, D)


class DeviceKVStore:
    """Device copies of a BatchSlotPool's key and value arrays, kept in sync by scattered writes."""

    def __init__(self, model_dir: Path, device: str, device_id: int, providers: list) -> None:
        path = Path(model_dir) / SLOT_WRITER_FILE
        if not path.exists():
            raise FileNotFoundError(f"{path} is missing: re-run `make export` to keep the KV cache on the device")
        self.device, self.device_id = device, device_id
        self.session = ort.InferenceSession(str(path), providers=providers)
        self.key: ort.OrtValue | None = None  # (L, B, Hkv, S, D) on the device
        self.value: ort.OrtValue | None = None
        self._spare: tuple[ort.OrtValue, ort.OrtValue] | None = None  # scatter target, swapped each write
        self._synced: tuple[int, int] | None = None  # (id of the pool, its repacks) the device copy holds
        self.uploads = 0  # full uploads (repacks)
        self.slot_writes = 0  # scattered slot writes (per layer, row and head)

    def sync(self, pool) -> tuple[ort.OrtValue, ort.OrtValue]:
        """Bring the device copy up to date with the host pool; returns (key, value) OrtValues."""
        if not pool.track_writes:
            raise ValueError("a device-mirrored pool must track its caches' writes (BatchSlotPool(track_writes=True))")
        if (id(pool), pool.repacks) != self._synced or self.key is None:
            self.key, self.value = self._upload(pool.key), self._upload(pool.value)
            self._spare = None
            self._synced = (id(pool), pool.repacks)
            pool.take_dirty()
            self.uploads += 1
            return self.key, self.value
        dirty = pool.take_dirty()  # (L, B, Hkv, S)
        updates = int(dirty.sum(axis=-1).max(initial=0))
        if updates:
            self._scatter(pool, dirty, updates)
        return self.key, self.value

    def _upload(self, array: np.ndarray) -> ort.OrtValue:
        return ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(array), self.device, self.device_id)

    def _scatter(self, pool, dirty: np.ndarray, updates: int) -> None:
        # Per (layer, row, head): its dirty slots first, then clean ones up to the common count T.
        # Rewriting a clean slot with its host value changes nothing, so no padding is needed.
        slot_index = np.argsort(~dirty, axis=-1, kind="stable")[..., :updates]  # (L, B, Hkv, T)
        expanded = np.ascontiguousarray(np.broadcast_to(slot_index[..., None], (*slot_index.shape, pool.key.shape[-1])))
        key_update = np.take_along_axis(pool.key, expanded, axis=SLOT_AXIS)  # (L, B, Hkv, T, D)
        value_update = np.take_along_axis(pool.value, expanded, axis=SLOT_AXIS)
        if self._spare is None:
            shape, element = pool.key.shape, pool.key.dtype.type
            self._spare = tuple(
                ort.OrtValue.ortvalue_from_shape_and_type(shape, element, self.device, self.device_id) for _ in range(2)
            )
        binding = self.session.io_binding()
        binding.bind_ortvalue_input("key", self.key)
        binding.bind_ortvalue_input("value", self.value)
        binding.bind_cpu_input("slot_index", expanded)
        binding.bind_cpu_input("key_update", key_update)
        binding.bind_cpu_input("value_update", value_update)
        binding.bind_ortvalue_output("updated_key", self._spare[0])
        binding.bind_ortvalue_output("updated_value", self._spare[1])
        self.session.run_with_iobinding(binding)
        (self.key, self.value), self._spare = self._spare, (self.key, self.value)
        self.slot_writes += int(dirty.sum())
