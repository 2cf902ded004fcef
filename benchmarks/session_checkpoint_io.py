"""What a session checkpoint costs the engine's step thread: a put (the end of a turn) with the
background writer vs the synchronous write it replaced, and a restore from disk (a cold hit, still
synchronous). Synthetic session states of SmolLM2-135M's shape (30 layers, 3 KV heads, head_dim 64,
fp32) at several cache sizes; prints a table and saves it as JSON.

    .venv/bin/python -m benchmarks.session_checkpoint_io [--repeats 21] [--out build/results/session_checkpoint_io.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvpop.sessions import SessionState, SessionStore, TierLimits, write_checkpoint

LAYERS, KV_HEADS, HEAD_DIM = 30, 3, 64  # SmolLM2-135M
FINGERPRINT = "b" * 64


@dataclass
class Row:
    slots: int
    checkpoint_mb: float
    sync_write_ms: float  # what a put cost the step thread before: encode, write, fsync, rename
    async_put_ms: float  # what it costs now: queue the state
    restore_ms: float  # a cold hit: read, verify the checksum, decode (the step thread waits)
    restore_p95_ms: float


def synthetic_state(slots: int, seed: int) -> SessionState:
    rng = np.random.default_rng(seed)
    shape = (LAYERS, KV_HEADS, slots, HEAD_DIM)
    return SessionState(
        fingerprint=FINGERPRINT, cache_options={"policy": "h2o", "budget": slots}, budget=slots,
        tokens=rng.integers(0, 49152, slots, dtype=np.int64), length=slots, peak_bytes=0,
        key=rng.standard_normal(shape, dtype=np.float32), value=rng.standard_normal(shape, dtype=np.float32),
        position=np.broadcast_to(np.arange(slots, dtype=np.int64), shape[:3]).copy(),
        statistics={"accumulated_attention": rng.random(shape[:3], dtype=np.float32)}, policy_state={},
    )


def milliseconds(samples: list[float]) -> float:
    return 1000 * statistics.median(samples)


def measure(slots: int, repeats: int, directory: Path) -> Row:
    directory.mkdir(parents=True)
    states = [synthetic_state(slots, seed) for seed in range(3)]
    sync = []
    for index in range(repeats):
        started = time.perf_counter()
        size = write_checkpoint(directory / "sync.safetensors", states[index % 3], owner="o" * 64).st_size
        sync.append(time.perf_counter() - started)
    # hot 0 / warm 0: every put is queued for the writer and its session leaves memory, as a demotion does
    store = SessionStore(TierLimits(hot_bytes=0, warm_bytes=0, cold_dir=directory / "store", cold_bytes=1 << 40), FINGERPRINT)
    puts, restores = [], []
    for index in range(repeats):
        started = time.perf_counter()
        store.put(f"s{index}", states[index % 3])
        puts.append(time.perf_counter() - started)
        store.flush()  # one write at a time: the put measured never waits for the disk
    for index in range(repeats):
        started = time.perf_counter()
        assert store.get(f"s{index}") is not None
        restores.append(time.perf_counter() - started)
        store.put(f"s{index}", states[index % 3])  # back out of memory for the next round's reads
        store.flush()
    store.close()
    return Row(slots, size / 2**20, milliseconds(sync), milliseconds(puts), milliseconds(restores),
               1000 * sorted(restores)[int(0.95 * (len(restores) - 1))])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slots", type=int, nargs="+", default=[256, 1024, 2048])
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--out", type=Path, default=Path("build/results/session_checkpoint_io.json"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        rows = [measure(slots, args.repeats, Path(directory) / str(slots)) for slots in args.slots]
    print(f"{'slots':>6} {'MB':>6} {'sync write ms':>14} {'async put ms':>13} {'restore ms':>11} {'p95':>7}")
    for row in rows:
        print(f"{row.slots:>6} {row.checkpoint_mb:>6.1f} {row.sync_write_ms:>14.2f} {row.async_put_ms:>13.3f} "
              f"{row.restore_ms:>11.2f} {row.restore_p95_ms:>7.2f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps([row.__dict__ for row in rows], indent=2) + "\n")


if __name__ == "__main__":
    main()
