"""The description of an exported decoder that the engine needs at serve time.

Written by `export` next to the ONNX files as `model_spec.json`, so the serving side never has to
import torch or transformers to know the cache geometry.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

MODEL_SPEC_FILENAME = "model_spec.json"


@dataclass(frozen=True)
class ModelSpec:
    architecture: str  # e.g. "LlamaForCausalLM"
    num_layers: int  # L
    num_attention_heads: int  # Hq
    num_kv_heads: int  # Hkv (grouped-query attention: Hq % Hkv == 0)
    head_dim: int  # D
    vocab_size: int  # V
    dtype: str  # numpy name of the KV / logits dtype, "float32" or "float16"
    max_position_embeddings: int
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    pad_token_id: int | None = None
    decoder_file: str = "decoder_step.onnx"

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        np.dtype(self.dtype)  # raises on an unknown dtype name

    @property
    def query_heads_per_kv_head(self) -> int:
        return self.num_attention_heads // self.num_kv_heads

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes one token occupies in the cache: keys and values, every layer and KV head."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * np.dtype(self.dtype).itemsize

    def save(self, directory: Path) -> Path:
        path = Path(directory) / MODEL_SPEC_FILENAME
        path.write_text(json.dumps(asdict(self), indent=2) + "\n")
        return path

    @classmethod
    def load(cls, directory: Path) -> "ModelSpec":
        data = json.loads((Path(directory) / MODEL_SPEC_FILENAME).read_text())
        data["eos_token_ids"] = tuple(data.get("eos_token_ids") or ())
        return cls(**data)
