"""Export `SlotCacheDecoderStep` (and its mixed decode + prompt variant) to ONNX with dynamic batch,
new-token and slot dimensions.

The TorchScript exporter (`torch.onnx.export(dynamo=False)`), not the dynamo one: on SmolLM2-135M it
takes a quarter of the CPU time (docs/DEPLOYMENT.md, "Exporting a model"), and its graphs serve at the
same speed once onnxruntime has optimised them at load (parity, the lean variants and the mixed step
pass the same checks). Two of its habits are undone here: it writes the weights inline (they go to one
external-data file), and constant folding stores a tied weight's transpose (the lm_head of tied
embeddings) as a second copy (`untie_transposes`).
"""

from __future__ import annotations

import hashlib
import tempfile
import warnings
from pathlib import Path

import numpy as np
import torch

from export.decoder_step import MIXED_OUTPUT_NAMES, MIXED_SEGMENTS, STEP_OUTPUT_NAMES, MixedDecoderStep, SlotCacheDecoderStep
from kvpop.decoder import CACHE_INPUTS, step_input_names

OPSET = 18


def example_step_inputs(step: SlotCacheDecoderStep, num_layers: int, batch: int = 2, new_tokens: int = 3, slots: int = 4,
                        dtype: torch.dtype = torch.float32) -> tuple:
    """Small inputs with every dynamic dimension >= 2 and all of them different, so that the traced
    graph reads each size from its own input. The caches as tuples of per-layer tensors, which the
    exporter flattens into one input each (`step_input_names`)."""
    layer_shape = (batch, step.num_kv_heads, slots, step.head_dim)
    return (
        torch.zeros(batch, new_tokens, dtype=torch.int64),
        torch.arange(slots, slots + new_tokens).repeat(batch, 1),
        tuple(torch.zeros(layer_shape, dtype=dtype) for _ in range(num_layers)),
        tuple(torch.zeros(layer_shape, dtype=dtype) for _ in range(num_layers)),
        torch.ones(batch, slots, dtype=torch.bool),
    )


def _step_axes(prefix: str, num_layers: int, batch: str, tokens: str | None, slots: str) -> dict[str, dict[int, str]]:
    """The dynamic axes of a step's inputs and outputs (names prefixed as in the mixed step)."""
    tokens_axis = {1: tokens} if tokens else {}
    key_axes = {1: batch, **({3: tokens} if tokens else {})}
    axes = {"input_ids": {0: batch, **tokens_axis}, "position_ids": {0: batch, **tokens_axis},
            **{f"{cache}.{layer}": {0: batch, 2: slots} for cache in CACHE_INPUTS for layer in range(num_layers)},
            "slot_mask": {0: batch, 1: slots},
            "logits": {0: batch, **tokens_axis}, "new_key": key_axes, "new_value": key_axes,
            "attention": {1: batch, **({3: tokens} if tokens else {}), 4: slots},
            "chunk_attention": {1: batch, **({3: tokens, 4: tokens} if tokens else {})}}
    return {prefix + name: dims for name, dims in axes.items()}


def untie_transposes(graph, min_bytes: int = 2**20) -> int:
    """Replace every large initializer that is the transpose of another one by a Transpose node on it
    (constant folding turned `lm_head = embed_tokens.T` into a second copy). -> bytes saved."""
    from onnx import helper, numpy_helper

    large = [initializer for initializer in graph.initializer
             if len(initializer.dims) == 2 and np.prod(initializer.dims) * 2 >= min_bytes]
    by_shape: dict[tuple[int, ...], list] = {}
    for initializer in large:
        by_shape.setdefault(tuple(initializer.dims), []).append(initializer)
    arrays: dict[str, np.ndarray] = {}

    def array(initializer) -> np.ndarray:
        if initializer.name not in arrays:
            arrays[initializer.name] = numpy_helper.to_array(initializer)
        return arrays[initializer.name]

    saved, removed = 0, set()
    for copy in large:
        for original in by_shape.get(tuple(reversed(copy.dims)), []):
            if original.name in (copy.name, *removed) or copy.name in removed:
                continue
            a, b = array(copy), array(original)
            if np.array_equal(a[:4, :4], b[:4, :4].T) and np.array_equal(a, b.T):
                removed.add(copy.name)
                saved += a.nbytes
                graph.node.insert(0, helper.make_node("Transpose", [original.name], [copy.name], perm=[1, 0],
                                                      name=f"untie_{copy.name}"))
    kept = [initializer for initializer in graph.initializer if initializer.name not in removed]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    return saved


def _trace(module: torch.nn.Module, inputs: tuple, axes: dict, input_names, output_names, scratch_dir: Path):
    """`module` traced to ONNX, tied transposes restored; -> the onnx.ModelProto, weights in memory."""
    import onnx

    with tempfile.TemporaryDirectory(dir=scratch_dir) as scratch:  # a model past 2 GB comes in many files
        traced = Path(scratch) / "traced.onnx"
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(module, inputs, str(traced), dynamo=False, input_names=input_names,
                              output_names=output_names, dynamic_axes=axes, opset_version=OPSET,
                              do_constant_folding=True)
        model = onnx.load(str(traced))
    untie_transposes(model.graph)
    return model


def export_decoder_step(causal_lm: torch.nn.Module, onnx_path: Path, dtype: torch.dtype = torch.float32) -> Path:
    """Write the decoder step as ONNX with weights, cache and logits in `dtype` (attention scores and
    softmax stay fp32, as `SlotCacheDecoderStep` computes them). `causal_lm` must already be in `dtype`.
    Weights go to one external-data file beside it (`<name>.data`)."""
    import onnx

    onnx_path = Path(onnx_path)
    onnx_path.parent.mkdir(parents=True, exist_ok=True)
    step = SlotCacheDecoderStep(causal_lm.eval()).eval()
    layers = len(step.decoder.layers)
    model = _trace(step, example_step_inputs(step, layers, dtype=dtype), _step_axes("", layers, "batch", "tokens", "slots"),
                   step_input_names(layers), STEP_OUTPUT_NAMES, onnx_path.parent)
    onnx.save(model, str(onnx_path), save_as_external_data=True, all_tensors_to_one_file=True,
              location=onnx_path.name + ".data")
    return onnx_path


def export_mixed_step(causal_lm: torch.nn.Module, onnx_path: Path, weights_of: Path, dtype: torch.dtype = torch.float32) -> Path:
    """Write the mixed decode + prompt step (`MixedDecoderStep`) as ONNX whose weights are those of the
    exported step `weights_of` (its external-data file): no second copy on disk. `causal_lm` in `dtype`."""
    import onnx

    onnx_path = Path(onnx_path)
    step = MixedDecoderStep(causal_lm.eval()).eval()
    layers = len(step.decoder.layers)
    decode = example_step_inputs(step, layers, batch=2, new_tokens=1, slots=5, dtype=dtype)
    prompt = example_step_inputs(step, layers, batch=3, new_tokens=4, slots=6, dtype=dtype)
    axes = {**_step_axes("decode_", layers, "decode_batch", None, "decode_slots"),
            **_step_axes("prompt_", layers, "prompt_batch", "prompt_tokens", "prompt_slots")}
    input_names = [name for segment in MIXED_SEGMENTS for name in step_input_names(layers, f"{segment}_")]
    names = set(input_names) | set(MIXED_OUTPUT_NAMES)
    model = _trace(step, decode + prompt, {name: dims for name, dims in axes.items() if name in names},
                   input_names, MIXED_OUTPUT_NAMES, onnx_path.parent)
    share_weights(model, Path(weights_of))
    onnx.save(model, str(onnx_path))  # the graph and the few weights the step does not store
    return onnx_path


def share_weights(model, weights_of: Path) -> int:
    """Point every initializer of `model` (weights in memory) whose bytes the exported step `weights_of`
    stores in its external-data file at that copy; the few others stay inline. Matched by content,
    not by name (the two exports name folded weights differently). -> bytes shared."""
    import onnx

    source = onnx.load(str(weights_of), load_external_data=False)
    by_content = {}
    for initializer in source.graph.initializer:
        if initializer.data_location == onnx.TensorProto.EXTERNAL:
            info = {entry.key: entry.value for entry in initializer.external_data}
            with open(Path(weights_of).parent / info["location"], "rb") as file:
                file.seek(int(info.get("offset", 0)))
                by_content[hashlib.sha1(file.read(int(info["length"]))).hexdigest()] = info
    shared = 0
    for initializer in model.graph.initializer:
        match = by_content.get(hashlib.sha1(initializer.raw_data).hexdigest()) if initializer.raw_data else None
        if match is None:  # not among the step's weights (small constants): kept in the graph file
            continue
        shared += len(initializer.raw_data)
        initializer.ClearField("raw_data")
        initializer.data_location = onnx.TensorProto.EXTERNAL
        for key, value in match.items():
            initializer.external_data.add(key=key, value=value)
    return shared
