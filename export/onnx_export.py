"""Export `SlotCacheDecoderStep` (and its mixed decode + prompt variant) to ONNX with dynamic batch,
new-token and slot dimensions."""

from __future__ import annotations

import hashlib
import warnings
from pathlib import Path

import torch

from export.decoder_step import (
    MIXED_INPUT_NAMES,
    MIXED_OUTPUT_NAMES,
    STEP_INPUT_NAMES,
    STEP_OUTPUT_NAMES,
    MixedDecoderStep,
    SlotCacheDecoderStep,
)


def example_step_inputs(step: SlotCacheDecoderStep, num_layers: int, batch: int = 2, new_tokens: int = 3, slots: int = 4,
                        dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    """Small inputs with every dynamic dimension >= 2, so the exporter does not specialise them."""
    cache_shape = (num_layers, batch, step.num_kv_heads, slots, step.head_dim)
    return (
        torch.zeros(batch, new_tokens, dtype=torch.int64),
        torch.arange(slots, slots + new_tokens).repeat(batch, 1),
        torch.zeros(cache_shape, dtype=dtype),
        torch.zeros(cache_shape, dtype=dtype),
        torch.ones(batch, slots, dtype=torch.bool),
    )


def _step_dynamic_shapes(prefix: str, batch, tokens, slots) -> dict:
    shapes = {"input_ids": {0: batch, 1: tokens}, "position_ids": {0: batch, 1: tokens}, "past_key": {1: batch, 3: slots},
              "past_value": {1: batch, 3: slots}, "slot_mask": {0: batch, 1: slots}}
    return {prefix + name: {axis: dim for axis, dim in axes.items() if dim is not None} for name, axes in shapes.items()}


def _export(module: torch.nn.Module, inputs: tuple, dynamic_shapes, input_names, output_names, onnx_path: Path) -> Path:
    onnx_path = Path(onnx_path)
    onnx_path.parent.mkdir(parents=True, exist_ok=True)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            module, inputs, dynamo=True, dynamic_shapes=dynamic_shapes, input_names=input_names,
            output_names=output_names, optimize=True, verbose=False,
        )
    program.save(str(onnx_path), external_data=True)
    return onnx_path


def export_decoder_step(causal_lm: torch.nn.Module, onnx_path: Path, dtype: torch.dtype = torch.float32) -> Path:
    """Write the decoder step as ONNX with weights, cache and logits in `dtype` (attention scores and
    softmax stay fp32, as `SlotCacheDecoderStep` computes them). `causal_lm` must already be in `dtype`.
    Weights go to an external-data file beside it."""
    step = SlotCacheDecoderStep(causal_lm.eval()).eval()
    dims = torch.export.Dim("batch"), torch.export.Dim("tokens"), torch.export.Dim("slots")
    return _export(step, example_step_inputs(step, len(step.decoder.layers), dtype=dtype), _step_dynamic_shapes("", *dims),
                   STEP_INPUT_NAMES, STEP_OUTPUT_NAMES, onnx_path)


def export_mixed_step(causal_lm: torch.nn.Module, onnx_path: Path, weights_of: Path, dtype: torch.dtype = torch.float32) -> Path:
    """Write the mixed decode + prompt step (`MixedDecoderStep`) as ONNX whose weights are those of the
    exported step `weights_of` (its external-data file): no second copy on disk. `causal_lm` in `dtype`."""
    step = MixedDecoderStep(causal_lm.eval()).eval()
    layers = len(step.decoder.layers)
    decode = example_step_inputs(step, layers, batch=2, new_tokens=1, slots=5, dtype=dtype)
    prompt = example_step_inputs(step, layers, batch=3, new_tokens=4, slots=6, dtype=dtype)
    dynamic_shapes = {
        **_step_dynamic_shapes("decode_", torch.export.Dim("decode_batch"), None, torch.export.Dim("decode_slots")),
        **_step_dynamic_shapes("prompt_", torch.export.Dim("prompt_batch"), torch.export.Dim("prompt_tokens"),
                               torch.export.Dim("prompt_slots")),
    }
    _export(step, decode + prompt, dynamic_shapes,
            MIXED_INPUT_NAMES, MIXED_OUTPUT_NAMES, onnx_path)
    share_weights(Path(onnx_path), Path(weights_of))
    return Path(onnx_path)


def share_weights(onnx_path: Path, weights_of: Path) -> int:
    """Point every external initializer of `onnx_path` whose bytes `weights_of` also stores at that
    file's copy, keep the few others inline, and delete `onnx_path`'s own data file. Matched by
    content, not by name (the exporter may name folded weights differently). -> bytes shared."""
    import onnx

    def external(initializer) -> dict[str, str]:
        return {entry.key: entry.value for entry in initializer.external_data}

    def read(directory: Path, info: dict[str, str]) -> bytes:
        with open(directory / info["location"], "rb") as file:
            file.seek(int(info.get("offset", 0)))
            return file.read(int(info["length"]))

    source = onnx.load(str(weights_of), load_external_data=False)
    by_content = {}
    for initializer in source.graph.initializer:
        if initializer.data_location == onnx.TensorProto.EXTERNAL:
            info = external(initializer)
            by_content[hashlib.sha1(read(weights_of.parent, info)).hexdigest()] = info
    model = onnx.load(str(onnx_path), load_external_data=False)
    own_files, shared = set(), 0
    for initializer in model.graph.initializer:
        if initializer.data_location == onnx.TensorProto.EXTERNAL:
            info = external(initializer)
            own_files.add(info["location"])
            data = read(onnx_path.parent, info)
        else:
            data = initializer.raw_data
        match = by_content.get(hashlib.sha1(data).hexdigest()) if data else None
        if match is None:  # not among the step's weights (small constants): kept in the graph file
            if initializer.data_location == onnx.TensorProto.EXTERNAL:
                del initializer.external_data[:]
                initializer.data_location = onnx.TensorProto.DEFAULT
                initializer.raw_data = data
            continue
        initializer.ClearField("raw_data")
        del initializer.external_data[:]
        initializer.data_location = onnx.TensorProto.EXTERNAL
        for key, value in match.items():
            initializer.external_data.add(key=key, value=value)
        shared += len(data)
    onnx.save(model, str(onnx_path))
    for name in own_files:
        (onnx_path.parent / name).unlink(missing_ok=True)
    return shared

