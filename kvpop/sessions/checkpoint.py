"""One session's state on disk: a single safetensors file, written atomically, never pickled.

Layout: the arrays as safetensors tensors, and in the header's `__metadata__` the JSON fields, the
session's keyed hash (its owner), the model fingerprint and a sha256 over every tensor. The file is
written to a temporary name in the same directory, flushed and fsynced, then `os.replace`d over the
old one, so a reader (or a restart after SIGKILL) sees the old checkpoint or the new one, never half
of one. Reading refuses, with a `CheckpointError` that says why, a file that is truncated, fails its
checksum, is not a session checkpoint, belongs to another session or to another model.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile
from pathlib import Path

import numpy as np
from safetensors import safe_open
from safetensors.numpy import load as load_tensors
from safetensors.numpy import save as save_tensors

from kvpop.sessions.state import SessionState

# Version 2: a kvpop cache that never evicted holds a learned scorer that has not taken its tokens in
# yet (KVpopPolicy catches it up when the cache first evicts); a version-1 state of such a cache had.
FORMAT, VERSION = "kvpop-session", 2
SUFFIX = ".safetensors"
MAX_HEADER_BYTES = 16 * 1024 * 1024


class CheckpointError(ValueError):
    """A checkpoint that must not be used; the store treats the session as missing."""


def _tensors(state: SessionState) -> dict[str, np.ndarray]:
    tensors = {"tokens": state.tokens, "key": state.key, "value": state.value, "position": state.position}
    tensors.update({f"statistic.{name}": stat for name, stat in state.statistics.items()})
    tensors.update(state.policy_arrays)
    return {name: np.ascontiguousarray(array) for name, array in tensors.items()}


def _checksum(tensors: dict[str, np.ndarray]) -> str:
    digest = hashlib.sha256()
    for name in sorted(tensors):
        array = tensors[name]
        digest.update(f"{name}:{array.dtype.str}:{array.shape}\n".encode())
        digest.update(np.ascontiguousarray(array).reshape(-1).view(np.uint8))  # no copy: tobytes() doubled a restore
    return digest.hexdigest()


def encode_checkpoint(state: SessionState, owner: str) -> bytes:
    tensors = _tensors(state)
    fields = {
        "cache_options": state.cache_options, "budget": state.budget, "length": state.length,
        "peak_bytes": state.peak_bytes, "statistics": sorted(state.statistics),
        "policy_state": state.policy_state, "policy_arrays": sorted(state.policy_arrays),
    }
    metadata = {
        "format": FORMAT, "version": str(VERSION), "owner": owner, "fingerprint": state.fingerprint,
        "checksum": _checksum(tensors), "state": json.dumps(fields, sort_keys=True),
    }
    return save_tensors(tensors, metadata=metadata)


def _header_metadata(data: bytes) -> dict:
    if len(data) < 8:
        raise CheckpointError("checkpoint is truncated (no header)")
    (header_length,) = struct.unpack("<Q", data[:8])
    if header_length > MAX_HEADER_BYTES or 8 + header_length > len(data):
        raise CheckpointError("checkpoint is truncated or corrupt (header length beyond the file)")
    try:
        header = json.loads(data[8 : 8 + header_length])
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise CheckpointError("checkpoint header is corrupt (not JSON)") from None
    metadata = header.get("__metadata__") if isinstance(header, dict) else None
    if not isinstance(metadata, dict) or metadata.get("format") != FORMAT:
        raise CheckpointError("not a KVpop session checkpoint")
    if metadata.get("version") != str(VERSION):
        raise CheckpointError(f"unsupported checkpoint version {metadata.get('version')!r}")
    return metadata


def _checked_metadata(head: bytes, owner: str, fingerprint: str) -> dict:
    """The header's metadata (`head`: the file's first bytes, at least its header) if it is `owner`'s
    checkpoint from this model."""
    metadata = _header_metadata(head)
    if metadata.get("owner") != owner:
        raise CheckpointError("checkpoint belongs to another session")
    if metadata.get("fingerprint") != fingerprint:
        raise CheckpointError("checkpoint was written by another model or scorer (fingerprint differs)")
    return metadata


def _state(metadata: dict, tensors: dict[str, np.ndarray], fingerprint: str) -> SessionState:
    if _checksum(tensors) != metadata.get("checksum"):
        raise CheckpointError("checkpoint is corrupt (checksum mismatch)")
    try:
        fields = json.loads(metadata["state"])
        return SessionState(
            fingerprint=fingerprint,
            cache_options=fields["cache_options"],
            budget=fields["budget"],
            tokens=tensors["tokens"],
            length=int(fields["length"]),
            peak_bytes=int(fields["peak_bytes"]),
            key=tensors["key"],
            value=tensors["value"],
            position=tensors["position"],
            statistics={name: tensors[f"statistic.{name}"] for name in fields["statistics"]},
            policy_state=fields["policy_state"],
            policy_arrays={name: tensors[name] for name in fields["policy_arrays"]},
        )
    except (KeyError, TypeError, ValueError, json.JSONDecodeError) as error:
        raise CheckpointError(f"checkpoint is corrupt (missing or bad field: {error})") from None


def decode_checkpoint(data: bytes, owner: str, fingerprint: str) -> SessionState:
    """The state in `data`; CheckpointError unless it is intact, `owner`'s, and from this model."""
    metadata = _checked_metadata(data, owner, fingerprint)
    try:
        tensors = load_tensors(data)
    except Exception as error:  # safetensors raises its own SafetensorError on bad offsets/lengths
        raise CheckpointError(f"checkpoint is truncated or corrupt ({error})") from None
    return _state(metadata, tensors, fingerprint)


def write_checkpoint(path: Path, state: SessionState, owner: str) -> os.stat_result:
    """Write atomically (temp file, fsync, os.replace). Returns the file's stat as written (size,
    mtime), taken before the rename: a later write of the same path cannot be mistaken for this one."""
    path = Path(path)
    data = encode_checkpoint(state, owner)
    descriptor, temporary = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=SUFFIX)
    try:
        with os.fdopen(descriptor, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
            written = os.fstat(handle.fileno())
        os.replace(temporary, path)  # the same inode: its mtime stays the one in `written`
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return written


def read_checkpoint(path: Path, owner: str, fingerprint: str) -> SessionState:
    """`decode_checkpoint` of a file. Only the header is read first (a foreign or misnamed file is
    refused before its tensors are touched); the tensors come through a memory map, each copied once
    from the page cache: reading the whole file into bytes first took ~40% longer per restore."""
    try:
        with open(path, "rb") as handle:
            head = handle.read(8)
            header_length = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
            head += handle.read(min(header_length, MAX_HEADER_BYTES))
    except OSError as error:
        raise CheckpointError(f"checkpoint cannot be read ({error.strerror})") from None
    metadata = _checked_metadata(head, owner, fingerprint)
    try:
        with safe_open(str(path), framework="numpy") as checkpoint:
            tensors = {name: checkpoint.get_tensor(name) for name in checkpoint.keys()}
    except Exception as error:  # SafetensorError on bad offsets or a short file; OSError
        raise CheckpointError(f"checkpoint is truncated or corrupt ({error})") from None
    return _state(metadata, tensors, fingerprint)
