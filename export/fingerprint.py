"""What an export was made from, so that `make export` with nothing changed does nothing.

Two fingerprints, stored in export_report.json: the decoder step's (the Hugging Face model's files, the
export code, the dtype, the torch / onnx / onnxruntime versions) and the scorers' (the trained scorer
files and their export code). The decoder step is exported again only when its fingerprint changed,
the scorers only when theirs did. Hashing SmolLM2's 540 MB of weights takes seconds, so each file's
digest is kept with its size and modification time and reused while both are unchanged.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, field
from importlib.metadata import version
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
# The code whose output an export is: change any of it and the export is redone.
DECODER_CODE = ("export/decoder_step.py", "export/onnx_export.py", "export/step_variants.py", "export/slot_writer.py",
                "export/parity.py", "export/pipeline.py", "kvpop/model_spec.py", "kvpop/decoder.py", "kvpop/device_store.py")
SCORER_CODE = ("export/scorer_onnx.py", "kvpop_train/scorer/network.py")
NOT_MODEL_INPUTS = (".md", ".log")  # a model card or a training log beside the weights


@dataclass
class Fingerprint:
    decoder: str  # digest of everything the decoder step, tokenizer and spec are made from
    scorers: str  # digest of the trained scorers and their export code ("" without scorers)
    files: dict[str, list] = field(default_factory=dict)  # path -> [size, mtime_ns, sha256], reused next time

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict | None) -> "Fingerprint | None":
        return cls(**data) if data else None


def _versions() -> str:
    """The versions of the libraries that write and check the export (read without importing them)."""
    return ", ".join(f"{name} {version(name)}" for name in ("torch", "transformers", "onnx", "onnxruntime"))


class _Hasher:
    def __init__(self, previous: Fingerprint | None) -> None:
        self.known = previous.files if previous else {}
        self.files: dict[str, list] = {}

    def file(self, path: Path) -> str:
        path = Path(path).resolve()
        stat = path.stat()
        known = self.known.get(str(path))
        if known and known[:2] == [stat.st_size, stat.st_mtime_ns]:
            digest = known[2]
        else:
            sha = hashlib.sha256()
            with open(path, "rb") as file:
                for block in iter(lambda: file.read(2**22), b""):
                    sha.update(block)
            digest = sha.hexdigest()
        self.files[str(path)] = [stat.st_size, stat.st_mtime_ns, digest]
        return digest

    def files_digest(self, paths: list[Path], root: Path) -> str:
        sha = hashlib.sha256()
        for path in sorted(paths):
            sha.update(f"{Path(path).relative_to(root)}\0{self.file(path)}\n".encode())
        return sha.hexdigest()


def model_inputs(model_dir: Path) -> list[Path]:
    """The files of a Hugging Face model directory an export reads: config, weights, tokenizer (its
    sub-folders, such as the reference model's training checkpoints, and dotfiles are not)."""
    return [path for path in Path(model_dir).iterdir()
            if path.is_file() and not path.name.startswith(".") and path.suffix not in NOT_MODEL_INPUTS]


def fingerprint(model_dir: Path, scorer_dir: Path, dtype: str, previous: Fingerprint | None = None) -> Fingerprint:
    hasher = _Hasher(previous)
    code = hasher.files_digest([REPO_ROOT / name for name in DECODER_CODE], REPO_ROOT)
    model = hasher.files_digest(model_inputs(model_dir), Path(model_dir))
    decoder = hashlib.sha256(f"{model} {code} {dtype} {_versions()}".encode()).hexdigest()
    scorer_files = [path for path in Path(scorer_dir).iterdir() if path.is_file()] if Path(scorer_dir).is_dir() else []
    scorers = ""
    if scorer_files:
        scorer_code = hasher.files_digest([REPO_ROOT / name for name in SCORER_CODE], REPO_ROOT)
        trained = hasher.files_digest(scorer_files, Path(scorer_dir))
        scorers = hashlib.sha256(f"{trained} {scorer_code} {_versions()}".encode()).hexdigest()
    return Fingerprint(decoder, scorers, hasher.files)
