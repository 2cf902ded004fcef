"""The one place evaluation and benchmarks build an engine: an exported model directory plus options.

Keeping construction here means a change of the engine's constructor touches one module of kvpop_eval.
"""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Any

from kvpop.decoder import DecoderStep
from kvpop.engine import Engine, EngineConfig, load_policy_assets
from kvpop.policies.kvpop.kinds import default_scorer

AUTO_SCORER = "auto"
CONFIG_FIELDS = {field.name for field in fields(EngineConfig)}


def build_engine(model_dir: Path | None = None, *, decoder: DecoderStep | None = None, device: str = "cpu",
                 engine_class: type[Engine] = Engine, **options: Any) -> Engine:
    """An engine over `model_dir` (its tokenizer and exported learned scorers), or over an already
    loaded `decoder` (several engines sharing one ONNX session; policy assets from `model_dir` unless
    given). `options`: EngineConfig fields (max_batch_size, prefill_chunk, ...) and the engine's
    services (policy_assets, tokenizer, sessions, prefixes)."""
    config = EngineConfig(**{name: value for name, value in options.items() if name in CONFIG_FIELDS})
    services = {name: value for name, value in options.items() if name not in CONFIG_FIELDS}
    if decoder is None:
        if model_dir is None:
            raise ValueError("build_engine needs a model directory or a decoder")
        return engine_class.from_model_dir(Path(model_dir), config, device=device, **services)
    if model_dir is not None:
        services.setdefault("policy_assets", load_policy_assets(Path(model_dir)))
    return engine_class(decoder, config, **services)


def resolve_scorer(name: str, learned_scorers: dict) -> str:
    """The kvpop policy's scorer as the service resolves its `kvpop_scorer` setting (`auto`: the learned
    mLSTM when the export has one, else the attention-based scorer)."""
    return default_scorer(name, learned_scorers)
