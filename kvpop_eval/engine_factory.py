"""The one place evaluation and benchmarks build an engine: an exported model directory plus options.

Keeping construction here means a change of the engine's constructor touches one module of kvpop_eval.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvpop.decoder import DecoderStep
from kvpop.engine import Engine, load_learned_scorers

AUTO_SCORER = "auto"


def build_engine(model_dir: Path | None = None, *, decoder: DecoderStep | None = None, device: str = "cpu",
                 engine_class: type[Engine] = Engine, **options: Any) -> Engine:
    """An engine over `model_dir` (its tokenizer and exported learned scorers), or over an already
    loaded `decoder` (several engines sharing one ONNX session; learned scorers from `model_dir` unless
    given). `options` are the engine's keywords (max_batch_size, prefill_chunk, ...)."""
    if decoder is None:
        if model_dir is None:
            raise ValueError("build_engine needs a model directory or a decoder")
        if engine_class is Engine:
            return Engine.from_model_dir(Path(model_dir), device=device, **options)
        decoder = DecoderStep(Path(model_dir), device=device)
    if model_dir is not None:
        options.setdefault("learned_scorers", load_learned_scorers(Path(model_dir)))
    return engine_class(decoder, **options)


def resolve_scorer(name: str, learned_scorers: dict) -> str:
    """The kvpop policy's scorer as the service resolves `auto` (ServiceConfig.kvpop_scorer): the learned
    mLSTM when the export has one, else the attention-based scorer."""
    if name != AUTO_SCORER:
        return name
    return "mlstm" if "mlstm" in learned_scorers else "accumulated_attention"
