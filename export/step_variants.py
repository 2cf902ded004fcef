"""Lean variants of the exported decoder step, for the serving engine's hot path (and the check of
the mixed decode + prompt step, exported from torch by export/onnx_export.py).

Why: the exported step (the contract, checked for parity) returns logits for every new position and
the attention every query put on every slot, (L, B, Hq, T, S) and (L, B, Hq, T, T). The engine samples
only from the last position, and only the attention-reading policies (h2o, tova, kvpop with an
attention-based scorer) look at the attention. On a 2048-token prefill of the full cache that is
tens of MB computed, stacked and copied to the host per chunk for nothing.

The variants are cut from the exported graph itself (no second torch export): the lm_head MatMul
reads only the last position (a Slice before it), and the attention outputs are dropped with every
node that only fed them. Their weights stay in the original external-data file (same names,
offsets), so a variant costs a few KB on disk.

    python -m export.step_variants DIR     # add the variants to an existing export
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from kvpop.decoder import split_caches, variant_paths  # "lean": last-position logits, new keys/values; "attention": + attention

ATTENTION_OUTPUTS = ("attention", "chunk_attention")


def _last_position_logits(graph) -> None:
    """Insert Slice(axis 1, last) on the activation input of the MatMul producing `logits`."""
    import onnx
    from onnx import helper

    producer = next(node for node in graph.node if "logits" in node.output)
    if producer.op_type not in ("MatMul", "Gemm"):
        raise ValueError(f"logits come from a {producer.op_type} node, expected the lm_head MatMul")
    initializers = {initializer.name for initializer in graph.initializer}
    constants = {out for node in graph.node if node.op_type == "Constant" for out in node.output}
    index = next(i for i, name in enumerate(producer.input) if name not in initializers and name not in constants)
    hidden = producer.input[index]
    names = {
        "starts": np.array([-1], np.int64),
        "ends": np.array([np.iinfo(np.int64).max], np.int64),
        "axes": np.array([1], np.int64),
    }
    for name, value in names.items():
        graph.initializer.append(onnx.numpy_helper.from_array(value, f"kvpop_last_{name}"))
    sliced = hidden + "_kvpop_last"
    slice_node = helper.make_node(
        "Slice", [hidden, "kvpop_last_starts", "kvpop_last_ends", "kvpop_last_axes"], [sliced], name="kvpop_last_position"
    )
    producer.input[index] = sliced
    position = list(graph.node).index(producer)
    graph.node.insert(position, slice_node)
    for output in graph.output:  # (B, T, V) -> (B, 1, V)
        if output.name == "logits":
            output.type.tensor_type.shape.dim[1].ClearField("dim_param")
            output.type.tensor_type.shape.dim[1].dim_value = 1


def _prune(graph) -> None:
    """Drop nodes no graph output depends on, and initializers no node reads."""
    producers = {name: node for node in graph.node for name in node.output}
    needed, stack, live = set(), [output.name for output in graph.output], set()
    while stack:
        name = stack.pop()
        if name in needed:
            continue
        needed.add(name)
        node = producers.get(name)
        if node is not None and id(node) not in live:
            live.add(id(node))
            stack.extend(node.input)
            for attribute in node.attribute:  # subgraphs (If/Loop) read outer names too
                for subgraph in list(attribute.g and [attribute.g] or []) + list(attribute.graphs):
                    stack.extend(name for sub in subgraph.node for name in sub.input)
    kept = [node for node in graph.node if id(node) in live]
    del graph.node[:]
    graph.node.extend(kept)
    used = {name for node in kept for name in node.input} | needed
    initializers = [initializer for initializer in graph.initializer if initializer.name in used]
    del graph.initializer[:]
    graph.initializer.extend(initializers)


def write_step_variants(decoder_path: Path) -> dict[str, Path]:
    """Write the lean and the attention variant of `decoder_path`; return their paths."""
    import onnx

    decoder_path = Path(decoder_path)
    paths = variant_paths(decoder_path)
    for kind, path in paths.items():
        model = onnx.load(str(decoder_path), load_external_data=False)  # weights stay where they are
        graph = model.graph
        _last_position_logits(graph)
        if kind == "lean":
            outputs = [output for output in graph.output if output.name not in ATTENTION_OUTPUTS]
            del graph.output[:]
            graph.output.extend(outputs)
        _prune(graph)
        onnx.save(model, str(path))
    return paths


def check_variants(decoder_path: Path, seed: int = 0) -> float:
    """Largest difference between each variant's outputs and the full step's on random inputs."""
    import onnxruntime as ort

    from kvpop.model_spec import ModelSpec

    decoder_path = Path(decoder_path)
    spec = ModelSpec.load(decoder_path.parent)
    rng = np.random.default_rng(seed)
    batch, tokens, slots = 2, 5, 7
    shape = (spec.num_layers, batch, spec.num_kv_heads, slots, spec.head_dim)
    feed = {
        "input_ids": rng.integers(0, spec.vocab_size, (batch, tokens)).astype(np.int64),
        "position_ids": np.tile(np.arange(slots, slots + tokens, dtype=np.int64), (batch, 1)),
        "past_key": rng.standard_normal(shape).astype(spec.dtype),
        "past_value": rng.standard_normal(shape).astype(spec.dtype),
        "slot_mask": np.arange(slots)[None, :] < np.array([[slots], [slots - 3]]),
    }
    feed = split_caches(feed)
    full = ort.InferenceSession(str(decoder_path), providers=["CPUExecutionProvider"])
    reference = dict(zip([output.name for output in full.get_outputs()], full.run(None, feed)))
    reference["logits"] = reference["logits"][:, -1:]
    worst = 0.0
    for path in variant_paths(decoder_path).values():
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        for output, value in zip(session.get_outputs(), session.run(None, feed)):
            if value.shape != reference[output.name].shape:
                raise ValueError(f"{path.name}: {output.name} has shape {value.shape}, expected {reference[output.name].shape}")
            worst = max(worst, float(np.abs(value.astype(np.float32) - reference[output.name].astype(np.float32)).max()))
    return worst


def check_mixed_step(decoder_path: Path, seed: int = 0) -> float:
    """Largest difference between the mixed step's outputs (export/onnx_export.py) and the full step's
    run on each segment alone, on random inputs: both segments, and each one empty."""
    import onnxruntime as ort

    from kvpop.decoder import mixed_step_path
    from kvpop.model_spec import ModelSpec

    decoder_path = Path(decoder_path)
    spec = ModelSpec.load(decoder_path.parent)
    rng = np.random.default_rng(seed)

    def segment(batch: int, tokens: int, slots: int) -> dict[str, np.ndarray]:
        shape = (spec.num_layers, batch, spec.num_kv_heads, slots, spec.head_dim)
        return {
            "input_ids": rng.integers(0, spec.vocab_size, (batch, tokens)).astype(np.int64),
            "position_ids": np.tile(np.arange(slots, slots + tokens, dtype=np.int64), (batch, 1)),
            "past_key": rng.standard_normal(shape).astype(spec.dtype),
            "past_value": rng.standard_normal(shape).astype(spec.dtype),
            "slot_mask": rng.random((batch, slots)) < 0.8,
        }

    full = ort.InferenceSession(str(decoder_path), providers=["CPUExecutionProvider"])
    mixed = ort.InferenceSession(str(mixed_step_path(decoder_path)), providers=["CPUExecutionProvider"])
    worst = 0.0
    for decode, prompt in ((segment(3, 1, 7), segment(2, 5, 9)), (segment(0, 1, 7), segment(2, 5, 9)), (segment(3, 1, 7), segment(0, 1, 0))):
        feed = {f"decode_{name}": value for name, value in decode.items()} | {f"prompt_{name}": value for name, value in prompt.items()}
        outputs = mixed.run(None, split_caches(split_caches(feed, "decode_"), "prompt_"))
        for inputs, (logits, new_key, new_value) in ((decode, outputs[:3]), (prompt, outputs[3:])):
            if len(inputs["input_ids"]) == 0:
                if logits.shape[0] or new_key.shape[1]:
                    raise ValueError(f"an empty segment gave outputs of shapes {logits.shape}, {new_key.shape}")
                continue
            reference = full.run(None, split_caches(inputs))
            for value, expected in ((logits, reference[0][:, -1:]), (new_key, reference[1]), (new_value, reference[2])):
                if value.shape != expected.shape:
                    raise ValueError(f"mixed step output of shape {value.shape}, expected {expected.shape}")
                worst = max(worst, float(np.abs(value.astype(np.float32) - expected.astype(np.float32)).max()))
    return worst


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="add the lean decoder-step variants to an exported model")
    parser.add_argument("model_dir", type=Path)
    args = parser.parse_args(argv)
    from kvpop.model_spec import ModelSpec

    decoder_path = args.model_dir / ModelSpec.load(args.model_dir).decoder_file
    paths = write_step_variants(decoder_path)
    difference = check_variants(decoder_path)
    print(f"wrote {', '.join(path.name for path in paths.values())}; largest difference from the full step {difference:.2e}")
    return 0 if difference <= 1e-5 else 1


if __name__ == "__main__":
    sys.exit(main())
