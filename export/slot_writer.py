"""The slot writer: a two-node ONNX graph that writes changed slots into a device-resident KV cache.

Why a graph and not a host copy: with the CUDA execution provider the batch's keys and values live in
GPU memory (kvpop.device_store). After each step the slot cache has overwritten one slot per head
and sequence on the host; re-uploading the whole cache would copy 2 * L * B * Hkv * S * D numbers per
token, which is exactly the traffic a bounded cache exists to avoid. This graph scatters only the T
changed slots per head (ScatterElements along the slot axis), so a decode step moves O(new tokens).

    key, value:             (L, B, Hkv, S, D)  the resident cache
    slot_index:             (L, B, Hkv, T, D)  int64, the slot of each update (repeated along D)
    key_update, value_update: (L, B, Hkv, T, D)
    -> updated_key, updated_value (L, B, Hkv, S, D)
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kvpop.device_store import SLOT_AXIS, SLOT_WRITER_FILE


def build_slot_writer(dtype: str = "float32"):
    """The writer as an onnx.ModelProto for caches of numpy dtype `dtype` (float32 or float16)."""
    import onnx
    from onnx import TensorProto, helper

    element = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    shape = ["layers", "batch", "kv_heads", "slots", "head_dim"]
    update_shape = ["layers", "batch", "kv_heads", "updates", "head_dim"]
    inputs = [
        helper.make_tensor_value_info("key", element, shape),
        helper.make_tensor_value_info("value", element, shape),
        helper.make_tensor_value_info("slot_index", TensorProto.INT64, update_shape),
        helper.make_tensor_value_info("key_update", element, update_shape),
        helper.make_tensor_value_info("value_update", element, update_shape),
    ]
    outputs = [
        helper.make_tensor_value_info("updated_key", element, shape),
        helper.make_tensor_value_info("updated_value", element, shape),
    ]
    nodes = [
        helper.make_node("ScatterElements", [cache, "slot_index", update], [out], axis=SLOT_AXIS)
        for cache, update, out in (("key", "key_update", "updated_key"), ("value", "value_update", "updated_value"))
    ]
    graph = helper.make_graph(nodes, "kvpop_slot_writer", inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], producer_name="kvpop-export")
    model.ir_version = 9  # readable by every onnxruntime >= 1.16
    onnx.checker.check_model(model)
    return model


def export_slot_writer(output_dir: Path, dtype: str = "float32") -> Path:
    import onnx

    path = Path(output_dir) / SLOT_WRITER_FILE
    onnx.save(build_slot_writer(dtype), path)
    return path
