"""A policy's per-sequence state (`SlotCache.policy_state`) as plain arrays and JSON, and back.

Continuing a sequence exactly needs its policy's state too: the random policy's generator position,
the learned scorer's recurrent memory and the tokens it has not consumed yet. Each kind of state is
written as named arrays plus a JSON description, never pickled, so a checkpoint can be read back by
nothing but this code. An unknown kind is refused when captured, not when restored.
"""

from __future__ import annotations

from typing import Any

import numpy as np

NONE, GENERATOR, SCORER = "none", "numpy_generator", "scorer_state"


def encode_policy_state(state: Any) -> tuple[dict, dict[str, np.ndarray]]:
    """(JSON description, arrays named `policy.*`) of a policy state; copies, never views."""
    if state is None:
        return {"kind": NONE}, {}
    if isinstance(state, np.random.Generator):
        return {"kind": GENERATOR, "bit_generator": state.bit_generator.state}, {}
    from kvpop.scorer.runtime import ScorerState

    if isinstance(state, ScorerState):
        arrays = {f"policy.recurrent.{name}": np.array(array) for name, array in state.recurrent.items()}
        arrays["policy.pending_key"] = np.array(state.pending_key)
        arrays["policy.pending_value"] = np.array(state.pending_value)
        return {"kind": SCORER, "recurrent": sorted(state.recurrent)}, arrays
    raise TypeError(f"cannot save a policy state of type {type(state).__name__}")


def decode_policy_state(description: dict, arrays: dict[str, np.ndarray]) -> Any:
    """The live policy state again (arrays copied: a restored sequence owns its state)."""
    kind = description.get("kind")
    if kind == NONE:
        return None
    if kind == GENERATOR:
        bit_state = description["bit_generator"]
        generator = np.random.Generator(getattr(np.random, bit_state["bit_generator"])())
        generator.bit_generator.state = bit_state
        return generator
    if kind == SCORER:
        from kvpop.scorer.runtime import ScorerState

        recurrent = {name: np.array(arrays[f"policy.recurrent.{name}"]) for name in description["recurrent"]}
        return ScorerState(recurrent, np.array(arrays["policy.pending_key"]), np.array(arrays["policy.pending_value"]))
    raise ValueError(f"unknown policy state kind {kind!r}")
