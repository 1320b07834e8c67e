"""Key-space progress: where a cursor sits between a range's ``lo`` and ``hi``.

The position is taken on the first key column where ``lo`` and ``hi`` differ, interpolated
numerically: integers, decimals, dates, timestamps, UUIDs, and text coarsely by its first 8 bytes
(monotonic, not uniform). A range at ``-inf`` or on a column with no number has no fraction
(``None``): callers then show counts only. ``core/rounds/status.py`` is the only user.
"""

from __future__ import annotations

import datetime as dt
import uuid
from decimal import Decimal
from typing import Any

from ..keys import MIN_KEY, decode_key

Axis = tuple[int, float | None, float]


def _number(v: Any) -> float | None:
    """A numeric position for one key component (None when it has no useful one)."""
    if isinstance(v, bool):
        return None
    if isinstance(v, (int, Decimal)):
        return float(v)
    if isinstance(v, dt.datetime):
        if v.tzinfo is None:
            return (v - dt.datetime(1970, 1, 1)).total_seconds()
        return v.timestamp()
    if isinstance(v, dt.date):
        return float(v.toordinal())
    if isinstance(v, uuid.UUID):
        return float(v.int)
    if isinstance(v, str):  # first 8 bytes as a big-endian number: coarse, but monotonic
        return float(int.from_bytes(v.encode("utf-8")[:8].ljust(8, b"\0"), "big"))
    return None


def key_axis(lo_enc: str, hi_enc: str) -> Axis | None:
    """(component index, lo position or None for -inf, hi position) of the first key column
    where ``lo`` and ``hi`` differ; None when no numeric axis exists."""
    hi = decode_key(hi_enc)
    lo = decode_key(lo_enc) if lo_enc != MIN_KEY else None
    for i, h in enumerate(hi):
        if lo is not None and i < len(lo) and lo[i] == h:
            continue
        hp = _number(h)
        lp = _number(lo[i]) if lo is not None and i < len(lo) else None
        if hp is None or (lo is not None and lp is None):
            return None
        return i, lp, hp
    return None


def key_position(axis: Axis | None, enc: str) -> float | None:
    """Where an encoded key sits on ``axis`` (None for -inf or when it has no position)."""
    if axis is None or enc == MIN_KEY:
        return None
    values = decode_key(enc)
    return _number(values[axis[0]]) if axis[0] < len(values) else None


def key_fraction(lo: str, hi: str, cursor: str, *, complete: bool = False) -> float | None:
    """Key-space progress of a cursor in ``(lo, hi]``, in [0, 1]; below 1 until it reaches hi."""
    if complete or cursor == hi:
        return 1.0
    if cursor == lo:
        return 0.0
    axis = key_axis(lo, hi)
    pos = key_position(axis, cursor)
    if axis is None or axis[1] is None or pos is None or axis[2] <= axis[1]:
        return None
    return min(max((pos - axis[1]) / (axis[2] - axis[1]), 0.0), 0.999)


def key_eta(lo: str, hi: str, before: str, after: str, seconds: float) -> float | None:
    """Seconds until ``hi`` at the key-space velocity from ``before`` to ``after`` (None when the
    cursor did not move or has no position). Needs no lower bound."""
    axis = key_axis(lo, hi)
    p0, p1 = key_position(axis, before), key_position(axis, after)
    if axis is None or p0 is None or p1 is None or p1 <= p0 or seconds <= 0:
        return None
    return (axis[2] - p1) / ((p1 - p0) / seconds)
