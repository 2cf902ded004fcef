"""Export a trained scorer to ONNX, its recurrent state as explicit inputs and outputs, and check parity.

`python -m export.scorer_onnx --scorers MODEL/scorer --out model_repository/kvpop_engine/1`
writes `scorer_<kind>.onnx` and `scorer_<kind>.json` (config, tensor names, state shapes, parity) for
every `scorer_<kind>.pt` found, and for a stateful kind `scorer_<kind>.decode.onnx`, the one-token decode
step of many sequences in one call. The runtime (kvpop.policies.kvpop.runtime) needs only those files.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.nn import functional

from kvpop_train.scorer.network import KINDS, STATE_NAMES, Scorer, ScorerConfig, load_scorer, mlstm_step

TOKEN_INPUTS = ("new_key", "new_value", "leaving_key", "leaving_value")
ATTENTION_INPUT = "leaving_attention"  # (L, Hkv, T), only with ScorerConfig.attention_feature
PARITY_TOLERANCE = 1e-4


def onnx_names(config: ScorerConfig) -> tuple[list[str], list[str]]:
    """(input names, output names) of the exported step; state outputs are the inputs with `_out`."""
    attention = [ATTENTION_INPUT] if config.attention_feature else []
    if not config.stateful:
        return ["leaving_key", "leaving_value", *attention], ["score"]
    return [*TOKEN_INPUTS, *attention, *STATE_NAMES], ["score", *(f"{name}_out" for name in STATE_NAMES)]


class _Step(nn.Module):
    """Flat named arguments in `onnx_names` order: ONNX has neither tuples of state nor optional inputs."""

    def __init__(self, scorer: Scorer) -> None:
        super().__init__()
        self.scorer = scorer
        self.input_names = onnx_names(scorer.config)[0]

    def forward(self, *inputs: torch.Tensor):
        named = dict(zip(self.input_names, inputs))
        leaving_key, leaving_value = named["leaving_key"], named["leaving_value"]
        score, state = self.scorer(
            named.get("new_key", leaving_key), named.get("new_value", leaving_value), leaving_key, leaving_value,
            tuple(named[name] for name in STATE_NAMES if name in named), named.get(ATTENTION_INPUT),
        )
        return (score, *state) if state else score


class _DecodeStep(nn.Module):
    """The scorer's decode step for B sequences in one call, the sequences in the token axis (L, Hkv,
    B, ...), each row with its own state, and the memory in its one-token recurrent form
    (`mlstm_step`): each sequence gets exactly its `Scorer.forward` step (tests/test_scorer.py).

    Why a second graph: the engine's decode step appends one token to every running sequence, and
    one ONNX call per sequence costs more than the scorer's arithmetic; the one-token recurrent form
    is a fraction of the chunk form's operations; and each onnxruntime node costs ~1 us on a CPU, so
    the weights are rearranged once here: the features' standardisation (affine) and the query's
    1 / sqrt(M) and the input gate's 1 / cap are folded into the projections, the leaving token's
    query and its share of the hidden layer are one matmul, the RoPE-pair norms one matmul, and the
    weights are shaped (L, Hkv, ...) so that nothing is reshaped."""

    def __init__(self, scorer: Scorer) -> None:
        super().__init__()
        config = scorer.config
        layers, kv_heads, dim, features = config.num_layers, config.num_kv_heads, config.head_dim, config.feature_dim
        memory, hidden = config.memory_dim, config.hidden_dim
        self.memory_dim, self.hidden_dim, self.cap = memory, hidden, config.input_gate_cap
        mean = scorer.feature_mean.detach().reshape(layers, kv_heads, 1, features)
        std = scorer.feature_std.detach().reshape(layers, kv_heads, 1, features)

        def per_head(tensor: torch.Tensor) -> torch.Tensor:  # (H, ...) -> (L, Hkv, ...)
            return tensor.detach().reshape(layers, kv_heads, *tensor.shape[1:])

        def standardised(weight: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            """((x - mean) / std) @ W + b == x @ W' + b' for raw features x."""
            weight, bias = per_head(weight), per_head(bias)  # (L, Hkv, F, out), (L, Hkv, 1, out)
            return weight / std.transpose(-1, -2), bias - (mean / std) @ weight

        write_weight, write_bias = standardised(scorer.write.weight, scorer.write.bias)
        write_weight[..., -2] /= self.cap  # the input gate's tanh cap: cap * tanh(g / cap)
        write_bias[..., -2] /= self.cap
        read_weight, read_bias = standardised(scorer.read.weight, scorer.read.bias)
        hidden_weight = scorer.hidden.weight
        leaving_weight, leaving_bias = standardised(hidden_weight[:, :features], scorer.hidden.bias)
        scale = 1.0 / math.sqrt(memory)
        pair = torch.zeros(dim, dim // 2)  # RoPE pairs coordinate i with i + D/2
        pair[torch.arange(dim // 2), torch.arange(dim // 2)] = 1.0
        pair[torch.arange(dim // 2) + dim // 2, torch.arange(dim // 2)] = 1.0
        self.register_buffer("pair", pair)  # (D, D/2)
        self.register_buffer("write_weight", write_weight)  # (L, Hkv, F, 2M + 2)
        self.register_buffer("write_bias", write_bias)
        self.register_buffer("leaving_weight", torch.cat([read_weight * scale, leaving_weight], dim=-1))  # (L, Hkv, F, M + N)
        self.register_buffer("leaving_bias", torch.cat([read_bias * scale, leaving_bias], dim=-1))
        self.register_buffer("read_weight", per_head(hidden_weight[:, features:]))  # (L, Hkv, M, N)
        self.register_buffer("output_weight", per_head(scorer.output.weight))  # (L, Hkv, N, 1)
        self.register_buffer("output_bias", per_head(scorer.output.bias))  # (L, Hkv, 1, 1)

    def raw_features(self, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """(L, Hkv, B, D) -> (L, Hkv, B, F): [key; value; key RoPE-pair norms], as Scorer.features before standardising."""
        return torch.cat([key, value, torch.sqrt((key * key) @ self.pair + 1e-12)], dim=-1)

    def forward(self, *inputs: torch.Tensor):  # onnx_names order: new/leaving key/value (L, Hkv, B, D), state
        new_key, new_value, leaving_key, leaving_value, memory, normaliser, stabiliser = inputs
        memory_dim = self.memory_dim
        written = self.raw_features(new_key, new_value) @ self.write_weight + self.write_bias  # (L, Hkv, B, 2M + 2)
        key, value, input_gate, forget_gate = written.split([memory_dim, memory_dim, 1, 1], dim=-1)
        log_input = self.cap * torch.tanh(input_gate)  # (L, Hkv, B, 1)
        log_forget = functional.logsigmoid(forget_gate)
        leaving = self.raw_features(leaving_key, leaving_value) @ self.leaving_weight + self.leaving_bias
        query, hidden = leaving.split([memory_dim, self.hidden_dim], dim=-1)  # (L, Hkv, B, M), (L, Hkv, B, N)
        read, new_memory, new_normaliser, new_stabiliser = mlstm_step(
            query, key, value, log_input[..., 0], log_forget[..., 0], memory, normaliser, stabiliser
        )
        hidden = functional.gelu(hidden + read @ self.read_weight)  # (L, Hkv, B, N)
        score = hidden @ self.output_weight + self.output_bias  # (L, Hkv, B, 1)
        return score[..., 0], new_memory, new_normaliser, new_stabiliser


def decode_graph_supported(config: ScorerConfig) -> bool:
    """Stateful kinds get a decode graph; a stateless scorer batches by rows in its plain graph, and
    one reading attention is never batched (its statistic needs each sequence's attention)."""
    return config.stateful and not config.attention_feature


def export_decode_step(scorer: Scorer, output_dir: Path) -> tuple[Path, float, float]:
    """Write scorer_<kind>.decode.onnx and return it with the max |diff| (and output scale) of a
    batch of 5 sequences against five single-sequence decode steps of the plain chunk graph's forward."""
    config = scorer.config
    input_names, output_names = onnx_names(config)
    batch = torch.export.Dim("batch", min=1, max=65536)
    path = Path(output_dir) / f"scorer_{config.kind}.decode.onnx"
    examples = [example_inputs(scorer, tokens=1, seed=seed) for seed in range(5)]
    # Sequence b in the token axis: tokens (L, Hkv, 1, D) -> (L, Hkv, B, D); states (L, Hkv, ...) -> (L, Hkv, B, ...).
    stacked = {name: torch.cat([example[name] for example in examples], dim=2) if name in TOKEN_INPUTS
               else torch.stack([example[name] for example in examples], dim=2) for name in input_names}
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            _DecodeStep(scorer), tuple(stacked[name] for name in input_names), dynamo=True,
            dynamic_shapes=(tuple({2: batch} for _ in input_names),),
            input_names=input_names, output_names=output_names, optimize=True, verbose=False,
        )
        program.save(str(path), external_data=False)
        import onnxruntime as ort

        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        got = session.run(output_names, {name: value.numpy() for name, value in stacked.items()})
        single = _Step(scorer)
        want = [single(*example.values()) for example in examples]  # (score (L, Hkv, 1), *state (L, Hkv, ...))
    expected = [torch.cat([w[0] for w in want], dim=2)] + [torch.stack([w[i] for w in want], dim=2) for i in range(1, len(got))]
    max_abs_diff = max(float(np.abs(e.numpy() - g).max()) for e, g in zip(expected, got))
    scale = max(float(e.abs().max()) for e in expected)
    return path, max_abs_diff, scale


def example_inputs(scorer: Scorer, tokens: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random inputs on the scale of the traces (the fitted feature statistics), with a warm state."""
    config = scorer.config
    generator = torch.Generator().manual_seed(seed)
    shape = (config.num_layers, config.num_kv_heads, tokens, config.head_dim)
    mean = scorer.feature_mean.reshape(config.num_layers, config.num_kv_heads, 1, -1)
    std = scorer.feature_std.reshape(config.num_layers, config.num_kv_heads, 1, -1)
    dim = config.head_dim

    def sample(part: slice) -> torch.Tensor:
        return mean[..., part] + std[..., part] * torch.randn(shape, generator=generator)

    inputs = {"new_key": sample(slice(0, dim)), "new_value": sample(slice(dim, 2 * dim))}
    inputs["leaving_key"], inputs["leaving_value"] = sample(slice(0, dim)), sample(slice(dim, 2 * dim))
    attention_mean = scorer.attention_mean.reshape(config.num_layers, config.num_kv_heads, 1)
    attention_std = scorer.attention_std.reshape(config.num_layers, config.num_kv_heads, 1)
    inputs[ATTENTION_INPUT] = attention_mean + attention_std * torch.randn(shape[:3], generator=generator)
    if config.stateful:  # a state reached by running the network, not zeros, so parity covers it
        warm = {k: sample(slice(0, dim)) if "key" in k else sample(slice(dim, 2 * dim)) for k in TOKEN_INPUTS}
        with torch.no_grad():
            _, state = scorer(*(warm[name] for name in TOKEN_INPUTS), scorer.initial_state(), inputs[ATTENTION_INPUT])
        inputs.update(zip(STATE_NAMES, state))
    names, _ = onnx_names(config)
    return {name: inputs[name] for name in names}


@dataclass
class ScorerExport:
    onnx_path: Path
    spec_path: Path
    max_abs_diff: float
    passed: bool


def export_scorer(scorer: Scorer, output_dir: Path, source: str = "") -> ScorerExport:
    """Write scorer_<kind>.onnx and scorer_<kind>.json into `output_dir`; check onnxruntime vs torch."""
    import onnxruntime as ort

    config = scorer.config
    scorer = scorer.float().eval()
    wrapper = _Step(scorer)
    input_names, output_names = onnx_names(config)
    tokens = torch.export.Dim("tokens")
    dynamic_shapes = ({2: tokens} if name in (*TOKEN_INPUTS, ATTENTION_INPUT) else None for name in input_names)
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    onnx_path = output_dir / f"scorer_{config.kind}.onnx"
    example = example_inputs(scorer, tokens=3)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            wrapper, tuple(example.values()), dynamo=True, dynamic_shapes=(tuple(dynamic_shapes),),
            input_names=input_names, output_names=output_names, optimize=True, verbose=False,
        )
    program.save(str(onnx_path), external_data=False)

    session = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    max_abs_diff = scale = 0.0
    for tokens_now, seed in ((1, 1), (5, 2), (64, 3)):  # decode step, short chunk, a full chunk
        inputs = example_inputs(scorer, tokens_now, seed)
        with torch.no_grad():
            expected = wrapper(*inputs.values())
        expected = expected if isinstance(expected, tuple) else (expected,)
        got = session.run(output_names, {name: value.numpy() for name, value in inputs.items()})
        for want, have in zip(expected, got):
            max_abs_diff = max(max_abs_diff, float(np.abs(want.numpy() - have).max()))
            scale = max(scale, float(want.abs().max()))
    decode_file = None
    if decode_graph_supported(config):
        decode_path, decode_diff, decode_scale = export_decode_step(scorer, output_dir)
        decode_file, max_abs_diff, scale = decode_path.name, max(max_abs_diff, decode_diff), max(scale, decode_scale)
    # Relative to the outputs' scale (at least 1), as the decoder step's parity: an mLSTM's memory state
    # grows with the tokens it has summed, and fp32 rounding of a value of 1e3 is already ~1e-4.
    passed = max_abs_diff <= PARITY_TOLERANCE * max(1.0, scale)
    spec = {
        "config": config.to_dict(),
        "onnx_file": onnx_path.name,
        "decode_onnx_file": decode_file,  # decode steps of B sequences in one call, (L, Hkv, B, ...) (stateful kinds)
        "inputs": input_names,
        "outputs": output_names,
        "state_shapes": {name: list(shape) for name, shape in config.state_shapes().items()},
        "parity": {"max_abs_diff": max_abs_diff, "output_scale": scale, "tolerance": PARITY_TOLERANCE,
                   "tolerance_is": "relative to max(1, output_scale)", "passed": passed},
        "source": source,
    }
    spec_path = output_dir / f"scorer_{config.kind}.json"
    spec_path.write_text(json.dumps(spec, indent=2) + "\n")
    return ScorerExport(onnx_path, spec_path, max_abs_diff, passed)


def export_scorers(scorer_dir: Path, output_dir: Path) -> list[ScorerExport]:
    """Export every scorer_<kind>.pt in `scorer_dir` (what `make export` calls); [] when none."""
    exports = []
    for kind in KINDS:
        checkpoint = Path(scorer_dir) / f"scorer_{kind}.pt"
        if checkpoint.exists():
            exports.append(export_scorer(load_scorer(checkpoint), output_dir, source=str(checkpoint)))
    return exports


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m export.scorer_onnx", description=__doc__.splitlines()[0])
    parser.add_argument("--scorers", type=Path, required=True, help="directory with scorer_<kind>.pt (train output)")
    parser.add_argument("--out", type=Path, required=True, help="model version directory to write into")
    args = parser.parse_args(argv)
    exports = export_scorers(args.scorers, args.out)
    if not exports:
        print(f"[export-scorer] no scorer_<kind>.pt in {args.scorers}", file=sys.stderr)
        return 1
    for export in exports:
        print(f"[export-scorer] {export.onnx_path} parity max |diff| {export.max_abs_diff:.2e} "
              f"({'ok' if export.passed else 'FAILED'})")
    return 0 if all(export.passed for export in exports) else 1


if __name__ == "__main__":
    raise SystemExit(main())
