"""Where the service keeps what must outlive its processes: session checkpoints and their key.

Never inside the model repository: repositories are often read-only (a container image, a volume
mounted `:ro`) or shared by several servers, and an export must not be mixed with a run's state. The
launcher's `--state-dir` (KVPOP_STATE_DIR) names the directory for every model the server loads; each
model keeps its state in a folder of its name there. A tritonserver started without it (by hand, or a
bare test server) uses `run/state` under its working directory.
"""

from __future__ import annotations

import os
from pathlib import Path

STATE_DIR_ENV = "KVPOP_STATE_DIR"
DEFAULT_STATE_DIR = Path("run") / "state"


def state_dir() -> Path:
    """The server's state directory (absolute): KVPOP_STATE_DIR, else run/state under the working directory."""
    return Path(os.environ.get(STATE_DIR_ENV) or DEFAULT_STATE_DIR).resolve()


def model_state_dir(model_name: str) -> Path:
    """One model's folder in the state directory (its instances share it)."""
    return state_dir() / model_name
