"""What the session store may hold per tier, and what it counts (read by the service's metrics)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from kvpop.request import Tier

HOT, WARM, COLD = Tier.HOT, Tier.WARM, Tier.COLD
TIERS = (HOT, WARM, COLD)


@dataclass(frozen=True)
class TierLimits:
    hot_bytes: int  # sessions kept in instance memory (counted against the KV pool)
    warm_bytes: int  # more kept in host memory
    cold_dir: Path | None = None  # checkpoints; None: no disk tier (sessions past warm are dropped)
    cold_bytes: int = 1 << 30
    cold_ttl_s: float = 24 * 3600.0
    write_through: bool = True  # checkpoint every put (survives a crash between turns)
    checkpoint_queue: int = 64  # checkpoint writes pending at most before a put waits for the disk

    def __post_init__(self) -> None:
        if self.hot_bytes < 0 or self.warm_bytes < 0 or self.cold_bytes < 0 or self.cold_ttl_s <= 0:
            raise ValueError(f"session tier limits must be >= 0 (ttl > 0), got {self}")
        if self.checkpoint_queue < 1:
            raise ValueError(f"checkpoint_queue must be >= 1, got {self.checkpoint_queue}")



@dataclass
class StoreCounters:
    lookups: int = 0
    hits: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    promotions: int = 0
    demotions: int = 0
    checkpoints_written: int = 0
    checkpoints_rejected: int = 0
    checkpoints_failed: int = 0  # writes that raised (disk full, permissions): the session stays in memory
    cold_removed: int = 0
    restore_seconds: list[float] = field(default_factory=list)  # cold reads since the last `take_restore_seconds`
