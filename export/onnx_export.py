"""Export `SlotCacheDecoderStep` to ONNX with dynamic batch, new-token and slot dimensions."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

from export.decoder_step import STEP_INPUT_NAMES, STEP_OUTPUT_NAMES, SlotCacheDecoderStep


def example_step_inputs(step: SlotCacheDecoderStep, num_layers: int) -> tuple[torch.Tensor, ...]:
    """Small inputs with every dynamic dimension >= 2, so the exporter does not specialise them."""
    batch, new_tokens, slots = 2, 3, 4
    cache_shape = (num_layers, batch, step.num_kv_heads, slots, step.head_dim)
    return (
        torch.zeros(batch, new_tokens, dtype=torch.int64),
        torch.arange(slots, slots + new_tokens).repeat(batch, 1),
        torch.zeros(cache_shape),
        torch.zeros(cache_shape),
        torch.ones(batch, slots, dtype=torch.bool),
    )


def export_decoder_step(causal_lm: torch.nn.Module, onnx_path: Path) -> Path:
    """Write the decoder step as ONNX (fp32). Weights go to an external-data file beside it."""
    step = SlotCacheDecoderStep(causal_lm.float().eval()).eval()
    batch = torch.export.Dim("batch")
    tokens = torch.export.Dim("tokens")
    slots = torch.export.Dim("slots")
    dynamic_shapes = {
        "input_ids": {0: batch, 1: tokens},
        "position_ids": {0: batch, 1: tokens},
        "past_key": {1: batch, 3: slots},
        "past_value": {1: batch, 3: slots},
        "slot_mask": {0: batch, 1: slots},
    }
    onnx_path = Path(onnx_path)
    onnx_path.parent.mkdir(parents=True, exist_ok=True)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            step,
            example_step_inputs(step, len(step.decoder.layers)),
            dynamo=True,
            dynamic_shapes=dynamic_shapes,
            input_names=STEP_INPUT_NAMES,
            output_names=STEP_OUTPUT_NAMES,
            optimize=True,
            verbose=False,
        )
    program.save(str(onnx_path), external_data=True)
    return onnx_path
