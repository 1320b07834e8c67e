"""``RoundPullResult``: what one ``traverse_round`` call (``PullLoop``, ``pull.py``) did."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .state import RangeResult


@dataclass
class RoundPullResult:
    """What one ``traverse_round`` call did: the ranges it ran (their cumulative counters), the
    splits it asked for, and why it returned."""

    round_id: str
    lineage: str
    ranges: list[RangeResult] = field(default_factory=list)
    splits_asked: int = 0  # split requests the owner answered or that timed out
    splits_won: int = 0  # requests that gave this call a new range
    yielded: str = ""  # "budget", "paused", "throttled", "unhealthy": call again later
    retry_after: float = 0.0  # "throttled"/"unhealthy": seconds worth waiting
    stopped: bool = False  # a stop was requested and honoured
    seconds: float = 0.0

    @property
    def finished(self) -> bool:
        """Nothing was left for this call to claim, rescue or split (the round may still have
        ranges running elsewhere: the barrier is what says the round is complete)."""
        return not self.yielded and not self.stopped

    @property
    def rows_read(self) -> int:
        return sum(r.rows_read for r in self.ranges)

    @property
    def chunks(self) -> int:
        return sum(r.chunks for r in self.ranges)

    def as_dict(self) -> dict[str, Any]:
        return {
            "round_id": self.round_id,
            "mode": "pull",
            "ranges": [r.range_id for r in self.ranges],
            "ranges_completed": sum(1 for r in self.ranges if r.complete),
            "ranges_coalesced": sum(r.coalesced for r in self.ranges),
            "rows_read": self.rows_read,
            "chunks": self.chunks,
            "splits_asked": self.splits_asked,
            "splits_won": self.splits_won,
            "seconds": round(self.seconds, 3),
            "yielded": self.yielded or None,
        }


__all__ = ["RoundPullResult"]
