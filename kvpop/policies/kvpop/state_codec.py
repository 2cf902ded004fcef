"""The learned scorer's per-sequence state (`ScorerState`) as plain arrays and JSON, and back.

Continuing a sequence exactly needs its scorer's recurrent memory and the tokens it has not consumed
yet. Written as named arrays plus a JSON description, never pickled, so a checkpoint can be read back
by nothing but this code (`KVpopPolicy.encode_state` / `decode_state`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

SCORER = "scorer_state"


def is_scorer_state(state: Any) -> bool:
    from kvpop.policies.kvpop.runtime import ScorerState

    return isinstance(state, ScorerState)


def encode(state) -> tuple[dict, dict[str, np.ndarray]]:
    """(JSON description, arrays named `policy.*`) of a scorer state; copies, never views."""
    arrays = {f"policy.recurrent.{name}": np.array(array) for name, array in state.recurrent.items()}
    arrays["policy.pending_key"] = np.array(state.pending_key)
    arrays["policy.pending_value"] = np.array(state.pending_value)
    return {"kind": SCORER, "recurrent": sorted(state.recurrent)}, arrays


def decode(description: dict, arrays: dict[str, np.ndarray]):
    """The live scorer state again (arrays copied: a restored sequence owns its state)."""
    from kvpop.policies.kvpop.runtime import ScorerState

    recurrent = {name: np.array(arrays[f"policy.recurrent.{name}"]) for name in description["recurrent"]}
    return ScorerState(recurrent, np.array(arrays["policy.pending_key"]), np.array(arrays["policy.pending_value"]))
