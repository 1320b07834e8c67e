"""Chunk size: rows per chunk bounded by a byte budget, steered toward a target duration.

Opt-in with ``TraverseOptions.target_chunk_seconds``. After each chunk the sizer learns the time
one row took (an exponentially weighted average of ``seconds / rows`` of the chunks seen, the
latest weighing half) and sizes the next chunk to last ``target`` seconds at that pace, within
``[min_size, max_size]`` and never more than doubling or halving in one step, so one odd chunk
(a GC pause, a cold cache) cannot swing the size wildly.

Byte budget (``TraverseOptions.max_chunk_bytes``, on by default): the sizer also learns the
bytes of a row (``approx_row_bytes`` of a few rows of each chunk, before the processor runs) and
caps the next read at ``max_bytes`` divided by that width, at least one row. The width it keeps
rises at once to a wider chunk's and falls back half way per chunk, so a chunk of wide rows shrinks
the next read immediately; before the first chunk it starts from the catalog's average row width
(``Dialect.row_width``) when the database has one. Within the cap, the duration steers (the
target's size is kept apart from the cap, so the cap lifting restores it). The budget counts the
rows' values as Python holds them (text by characters, numbers 8 bytes), not the driver's or the
interpreter's overhead; with prefetch two chunks are held at once.

Only the ``LIMIT`` of the next read changes: the cursor contract is untouched (the cursor still
moves to the last key processed, committed with its counters), and the replay bound after a crash
becomes one chunk of at most ``max_size`` rows (one group with group commit).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

#: bytes counted for a value that is not text or bytes (numbers, dates, booleans, NULL)
SCALAR_BYTES = 8


def approx_row_bytes(rows: Sequence[tuple]) -> float:
    """Average bytes of ``rows`` (see module doc; 0.0 for no rows)."""
    if not rows:
        return 0.0
    total = 0
    for row in rows:
        for v in row:
            if isinstance(v, (str, bytes, bytearray, memoryview)):
                total += len(v)
            elif v is None or isinstance(v, (int, float)):
                total += SCALAR_BYTES
            elif isinstance(v, (dict, list, tuple)):
                total += len(str(v))  # JSON documents, arrays
            else:
                total += SCALAR_BYTES
    return total / len(rows)


@dataclass
class ChunkSizer:
    """``size`` is the next chunk's row limit; ``observe(rows, seconds)`` after each chunk and
    ``observe_width(bytes_per_row)`` when its rows are seen. ``target_seconds`` None: no duration
    steering (the size stays at the start, capped by the byte budget)."""

    size: int
    target_seconds: float | None
    min_size: int
    max_size: int
    max_bytes: int | None = None
    row_bytes: float | None = None  # bytes per row (catalog estimate, then the chunks')
    weight: float = 0.5  # how much the latest chunk counts in the per-row time
    per_row: float | None = None  # smoothed seconds per row
    history: list[int] = field(default_factory=list)  # sizes chosen (bounded, for logs/tests)
    steered: int = 0  # the duration's choice, before the byte cap

    def __post_init__(self) -> None:
        if self.target_seconds is not None:
            self.size = min(max(self.size, self.min_size), self.max_size)
        self.steered = self.size
        self._cap()

    def byte_cap(self) -> int | None:
        """The most rows the byte budget allows at the width known now (None: no budget/width)."""
        if not self.max_bytes or not self.row_bytes:
            return None
        return max(1, int(self.max_bytes / self.row_bytes))

    def _cap(self) -> int:
        cap = self.byte_cap()
        self.size = self.steered if cap is None else min(self.steered, cap)
        if len(self.history) < 1000:
            self.history.append(self.size)
        return self.size

    def observe_width(self, bytes_per_row: float) -> int:
        """Learn the width of a chunk's rows; returns the next size."""
        if bytes_per_row <= 0:
            return self.size
        prev = self.row_bytes
        self.row_bytes = (
            bytes_per_row if prev is None else max(bytes_per_row, (bytes_per_row + prev) / 2)
        )
        return self._cap()

    def observe(self, rows: int, seconds: float) -> int:
        """Learn from a chunk of ``rows`` that took ``seconds``; returns the next size."""
        if rows <= 0 or seconds <= 0 or self.target_seconds is None:
            return self.size
        sample = seconds / rows
        self.per_row = (
            sample
            if self.per_row is None
            else self.weight * sample + (1 - self.weight) * self.per_row
        )
        ideal = self.target_seconds / self.per_row
        # steps from the size read (the byte cap may have lowered it), at most 2x either way
        base = self.size
        step = min(max(ideal, base / 2), base * 2)
        self.steered = int(min(max(step, self.min_size), self.max_size))
        return self._cap()


__all__ = ["SCALAR_BYTES", "ChunkSizer", "approx_row_bytes"]
