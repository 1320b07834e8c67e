"""Adaptive chunk size: steer the rows per chunk toward a target duration per chunk.

Opt-in with ``TraverseOptions.target_chunk_seconds``. After each chunk the sizer learns the time
one row took (an exponentially weighted average of ``seconds / rows`` of the chunks seen, the
latest weighing half) and sizes the next chunk to last ``target`` seconds at that pace, within
``[min_size, max_size]`` and never more than doubling or halving in one step, so one odd chunk
(a GC pause, a cold cache) cannot swing the size wildly.

Only the ``LIMIT`` of the next read changes: the cursor contract is untouched (the cursor still
moves to the last key processed, committed with its counters), and the replay bound after a crash
becomes one chunk of at most ``max_size`` rows (one group with group commit).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ChunkSizer:
    """``size`` is the next chunk's row limit; ``observe(rows, seconds)`` after each chunk."""

    size: int
    target_seconds: float
    min_size: int
    max_size: int
    weight: float = 0.5  # how much the latest chunk counts in the per-row time
    per_row: float | None = None  # smoothed seconds per row
    history: list[int] = field(default_factory=list)  # sizes chosen (bounded, for logs/tests)

    def __post_init__(self) -> None:
        self.size = min(max(self.size, self.min_size), self.max_size)

    def observe(self, rows: int, seconds: float) -> int:
        """Learn from a chunk of ``rows`` that took ``seconds``; returns the next size."""
        if rows <= 0 or seconds <= 0:
            return self.size
        sample = seconds / rows
        self.per_row = (
            sample
            if self.per_row is None
            else self.weight * sample + (1 - self.weight) * self.per_row
        )
        ideal = self.target_seconds / self.per_row
        step = min(max(ideal, self.size / 2), self.size * 2)
        self.size = int(min(max(step, self.min_size), self.max_size))
        if len(self.history) < 1000:
            self.history.append(self.size)
        return self.size


__all__ = ["ChunkSizer"]
