"""The named states of rounds and ranges: the only values the store writes in a ``state`` field.

The Lua scripts (``core/store/lua/*.lua``) spell the same strings. ``core/rounds/status.py`` (the
status model
that reads them) re-exports these names, so ``from airflow_keyset_provider.core.rounds.status import
RangeState`` keeps working.
"""

from __future__ import annotations

from enum import StrEnum


class RangeState(StrEnum):
    """What the store records in a range's ``state`` field."""

    PENDING = "pending"  #: not claimed yet, released unfinished, or re-opened by a replay
    RUNNING = "running"  #: claimed by an owner token (its lease may have run out since)
    COMPLETE = "complete"  #: cursor at ``hi`` and no item waiting for a retry (terminal)


class RoundState(StrEnum):
    """What the store records in a round's ``state`` field."""

    OPEN = "open"  #: planned; ranges are being traversed
    CLOSED = "closed"  #: every range complete, coverage proven, watermark moved (terminal)
    UNRECOVERABLE = "unrecoverable"  #: the source lost rows the round had to read; never closes


def range_state(value: str) -> RangeState | str:
    """The named state for a stored value (an unknown value is passed through, never hidden)."""
    try:
        return RangeState(value)
    except ValueError:
        return value


def round_state(value: str) -> RoundState | str:
    try:
        return RoundState(value)
    except ValueError:
        return value
