"""What a saved session must match to be continued: the model's weights and the scorer networks.

A checkpoint restored into another model (or a re-exported one) would continue with keys and values
the new weights never produced; it must be refused, not silently used. The fingerprint hashes
`model_spec.json` and every exported ONNX file (the decoder variants and the scorers). Files up to
`FULL_HASH_BYTES` are hashed whole; a larger one by its size and its first and last MiB, which
changes with any re-export in practice (the ONNX header carries the graph, the tail the weights)
and keeps a 500 MB model's load from reading it all again.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

FULL_HASH_BYTES = 64 * 1024 * 1024
_SAMPLE = 1024 * 1024


def file_digest(path: Path) -> str:
    path = Path(path)
    size = path.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    with path.open("rb") as handle:
        if size <= FULL_HASH_BYTES:
            for block in iter(lambda: handle.read(_SAMPLE), b""):
                digest.update(block)
        else:
            digest.update(handle.read(_SAMPLE))
            handle.seek(size - _SAMPLE)
            digest.update(handle.read(_SAMPLE))
    return digest.hexdigest()


def model_fingerprint(model_dir: Path) -> str:
    """sha256 over the model's spec and ONNX files (decoder variants and scorers), by file name."""
    model_dir = Path(model_dir)
    files = sorted(
        path for path in model_dir.iterdir()
        if path.is_file() and (path.suffix in (".onnx", ".data") or path.name == "model_spec.json"
                               or (path.name.startswith("scorer_") and path.suffix == ".json"))
    )
    digest = hashlib.sha256()
    for path in files:
        digest.update(f"{path.name}:{file_digest(path)}\n".encode())
    return digest.hexdigest()
