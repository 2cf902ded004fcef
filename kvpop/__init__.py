"""KVpop engine: a fixed-budget per-head KV slot cache, eviction policies and the generation loop.

The serving runtime needs only numpy and onnxruntime; torch is used by export and training tools.
"""

from kvpop.model_spec import ModelSpec

__all__ = ["ModelSpec"]
