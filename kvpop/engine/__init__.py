"""The generation loop: `Engine` (requests in, step, finish) over a `Scheduler` (what runs next: the one
waiting queue, admission by KV memory, each step's prompt work) and a `ModelRunner` (the decoder calls),
configured by one `EngineConfig`.

Build one from an exported model directory with `Engine.from_model_dir(model_dir, EngineConfig(...))`.
"""

from kvpop.engine.config import EngineConfig
from kvpop.engine.engine import Engine
from kvpop.engine.sequence import EngineState, Phase, SequenceState
from kvpop.policies import load_policy_assets

__all__ = ["Engine", "EngineConfig", "EngineState", "Phase", "SequenceState", "load_policy_assets"]
