"""A Triton model repository assembled from the committed models and one exported model.

Why not a copy of the checkout's `model_repository/`: after `make export` its `kvpop_engine/1` holds
that export (SmolLM2's decoder, tokenizer, scorers, retrieval heads), and laying another export over it
leaves every file the other one does not write beside it (a 2-layer model reading SmolLM2's retrieval
heads fails to load). So only what git tracks of a model is copied (its `config.pbtxt`, `configs/` and
`1/model.py`), then the export; nothing a run or an earlier export left there comes along. The test
servers, the cluster rehearsal, the load-time and service benchmarks all build their repository here.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

MODEL_REPOSITORY = Path(__file__).resolve().parent.parent / "model_repository"
ENGINE_MODEL = "kvpop_engine"  # the model whose version folder holds the export
VERSION = "1"
MODEL_CODE = "model.py"


def model_files(source: Path = MODEL_REPOSITORY) -> list[Path]:
    """The committed files of every model in `source`, relative to it: each config, its variants, its code."""
    files = []
    for model in sorted(path for path in Path(source).iterdir() if (path / "config.pbtxt").is_file()):
        files.append(model / "config.pbtxt")
        files += sorted((model / "configs").glob("*.pbtxt"))
        files.append(model / VERSION / MODEL_CODE)
    return [path.relative_to(source) for path in files]


def assemble_model_repository(root: Path, exported_model: Path, engine_parameters: dict[str, str] | None = None,
                              source: Path = MODEL_REPOSITORY) -> Path:
    """Write into `root` the models of `source` (their committed files only) with `exported_model` in
    kvpop_engine/1, and `engine_parameters` set in every kvpop_engine config. -> root"""
    root = Path(root)
    for relative in model_files(source):
        (root / relative).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(Path(source) / relative, root / relative)
    shutil.copytree(exported_model, root / ENGINE_MODEL / VERSION, dirs_exist_ok=True)
    engine = root / ENGINE_MODEL
    for config in [engine / "config.pbtxt", *(engine / "configs").glob("*.pbtxt")]:
        text = config.read_text()
        for key, value in (engine_parameters or {}).items():
            text, count = re.subn(rf'(key: "{key}" value: {{ string_value: )"[^"]*"', rf'\1"{value}"', text)
            if count != 1:
                raise ValueError(f"parameter {key} is not in {config}")
        config.write_text(text)
    return root
