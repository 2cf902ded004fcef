"""What export writes beside a learned scorer's ONNX file (scorer_<kind>.json), and the base model's
retrieval heads beside it: everything the runtime must know about a scorer before it runs one."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from kvpop.policies.kvpop.text_spans import check_span_pooling

RETRIEVAL_HEADS_FILE = "retrieval_heads.json"  # beside the scorers: kvpop_train.scorer.retrieval_heads writes it


@dataclass(frozen=True)
class ScorerSpec:
    """What export wrote beside the ONNX file (scorer_<kind>.json)."""

    kind: str
    window: int  # the protected window the scorer was trained for
    num_layers: int
    num_kv_heads: int
    head_dim: int
    attention_feature: bool  # the step also takes the leaving tokens' log relative in-window attention
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    state_shapes: dict[str, tuple[int, ...]]
    onnx_file: str
    decode_onnx_file: str | None = None  # B sequences' one-token steps in one call (stateful kinds)
    shared_ranking: bool = False  # one model-wide ranking: a token's score is the mean over all L * Hkv caches
    span_pooling: str = ""  # "line" / "line_contrast": prompt tokens ranked by their line (text_spans.py; shared_ranking)
    # (layer, KV head) pairs whose question attention finds what a question asks about: the base model's
    # retrieval heads (kvpop_train.scorer.retrieval_heads), from retrieval_heads.json beside the scorers; () if none
    retrieval_heads: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        check_span_pooling(self.span_pooling, self.shared_ranking)
        for layer, head in self.retrieval_heads:
            if not (0 <= layer < self.num_layers and 0 <= head < self.num_kv_heads):
                raise ValueError(f"retrieval head ({layer}, {head}) outside the model's {self.num_layers} x {self.num_kv_heads}")

    @classmethod
    def load(cls, path: Path) -> "ScorerSpec":
        data = json.loads(Path(path).read_text())
        config = data["config"]
        heads_file = Path(path).parent / RETRIEVAL_HEADS_FILE
        heads = json.loads(heads_file.read_text())["heads"] if heads_file.exists() else ()
        return cls(
            kind=config["kind"], window=config["window"], num_layers=config["num_layers"],
            num_kv_heads=config["num_kv_heads"], head_dim=config["head_dim"],
            attention_feature=config.get("attention_feature", False),
            inputs=tuple(data["inputs"]), outputs=tuple(data["outputs"]),
            state_shapes={name: tuple(shape) for name, shape in data["state_shapes"].items()},
            onnx_file=data["onnx_file"], decode_onnx_file=data.get("decode_onnx_file"),
            shared_ranking=config.get("shared_ranking", False),
            span_pooling=config.get("span_pooling", ""),
            retrieval_heads=tuple((int(layer), int(head)) for layer, head in heads),
        )
