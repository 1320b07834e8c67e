"""Repetitions, interleaving and medians.

Variants of one comparison run round-robin (A B C, A B C, ...) rather than all of A then all of
B, so drift from other load on the machine hits every variant alike; the verdict uses medians.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Sample:
    """One timed repetition: wall seconds, rows handled, anything else worth keeping."""

    seconds: float
    rows: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def rate(self) -> float:
        return self.rows / self.seconds if self.seconds > 0 else 0.0


class Stopwatch:
    """``with Stopwatch() as sw: ...`` then ``sw.seconds`` (perf_counter)."""

    seconds: float = 0.0

    def __enter__(self) -> Stopwatch:
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self._t0


@contextmanager
def timed() -> Iterator[Stopwatch]:
    with Stopwatch() as sw:
        yield sw


def interleaved(variants: dict[str, Callable[[], Sample]], repeat: int) -> dict[str, list[Sample]]:
    """Run every variant ``repeat`` times, round-robin; returns the samples per variant."""
    out: dict[str, list[Sample]] = {name: [] for name in variants}
    for _ in range(repeat):
        for name, fn in variants.items():
            out[name].append(fn())
    return out


def median(values: list[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


def median_rate(samples: list[Sample]) -> float:
    return median([s.rate for s in samples])


def median_seconds(samples: list[Sample]) -> float:
    return median([s.seconds for s in samples])


def spread(samples: list[Sample], rate: bool = True) -> dict[str, float]:
    """min / median / max of the repetitions, for the JSON details (shows the noise)."""
    vals = [s.rate if rate else s.seconds for s in samples]
    return {"min": min(vals), "median": median(vals), "max": max(vals)} if vals else {}
