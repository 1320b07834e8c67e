"""Splitting a round ``(start, end]`` into ranges.

Guarantee (``split``): the ranges are half-open ``(lo, hi]``, in order, pairwise disjoint, their
union is exactly ``(start, end]``, there are at most ``max_ranges`` of them, and every inner
boundary is one of the given cut keys (real keys read from the source). A round with
``start == end`` is one empty range. Balance comes from where the cuts are: the source picks them
as row-count quantiles (statistics or sampling on big tables, exact on small ones).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import Any

from ..errors import ConfigurationError

# The engine's own ceiling on ranges per round: every range is a Redis hash written when the round
# is planned (one Lua call) and read by every barrier check and status view, so the round's control
# state grows with this number. Airflow adds its own cap, ``[core] max_map_length`` (1024 by
# default): the operators read it from Airflow's configuration, the engine does not know it.
MAX_RANGES = 100_000


def check_max_ranges(max_ranges: Any) -> None:
    """Refuse a ``max_ranges`` that is not an integer from 1 to ``MAX_RANGES``."""
    is_int = isinstance(max_ranges, int) and not isinstance(max_ranges, bool)
    if not is_int or not 1 <= max_ranges <= MAX_RANGES:
        raise ConfigurationError(
            f"max_ranges must be an integer from 1 to {MAX_RANGES} (the engine's limit on "
            f"ranges per round), got {max_ranges!r}"
        )


def split(start: str, end: str, cuts: Iterable[str], max_ranges: int) -> list[tuple[str, str]]:
    """Ranges covering ``(start, end]`` exactly, cut at (a subset of) ``cuts``."""
    if max_ranges < 1:
        raise ValueError("max_ranges must be >= 1")
    if end < start:
        raise ValueError("end < start")
    inner = sorted({c for c in cuts if start < c < end})
    if len(inner) > max_ranges - 1:
        # keep max_ranges - 1 cuts spread evenly over the candidates
        step = len(inner) / max_ranges
        inner = sorted({inner[int(step * i)] for i in range(1, max_ranges)})
    points = [start, *inner, end]
    return list(itertools.pairwise(points))
