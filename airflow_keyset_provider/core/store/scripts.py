"""The cursor store's Lua scripts (see ``store.py`` for the key layout and the guarantees).

Each script is headed by the KEYS it touches (all of one stream, sharing its hash tag), its ARGV
and what it returns. Times come from the Redis server's ``TIME``. The state strings are those of
``core/states.py``: rounds ``open``/``closed``/``unrecoverable``, ranges ``pending``/``running``/
``complete``.

This module is the one import surface; the scripts live by concern in ``store_scripts_round.py``
(a round: create, close, restore, ...), ``store_scripts_range.py`` (one range: claim, heartbeat,
advance, release, ...) and ``store_scripts_pull.py`` (pulling ranges and splitting them), and the
Lua fragments they share (``now``, ``intact``, ``fields``) in ``store_lua.py``.
"""

from __future__ import annotations

from .scripts_pull import NEXT_UNCLAIMED, OPEN_BRIEFS, REQUEST_SPLIT, SPLIT, SPLIT_ANSWER
from .scripts_range import ADVANCE, CLAIM, HEARTBEAT, RELEASE, REQUEUE_DEAD, SNAPSHOT_RANGES
from .scripts_round import (
    CLOSE_ROUND,
    CREATE_ROUND,
    DELETE_ROUND,
    MARK_UNRECOVERABLE,
    RAISE_COUNTER,
    REFRESH_TOTALS,
    RESTORE_ROUND,
)

__all__ = [
    "ADVANCE",
    "CLAIM",
    "CLOSE_ROUND",
    "CREATE_ROUND",
    "DELETE_ROUND",
    "HEARTBEAT",
    "MARK_UNRECOVERABLE",
    "NEXT_UNCLAIMED",
    "OPEN_BRIEFS",
    "RAISE_COUNTER",
    "REFRESH_TOTALS",
    "RELEASE",
    "REQUEST_SPLIT",
    "REQUEUE_DEAD",
    "RESTORE_ROUND",
    "SNAPSHOT_RANGES",
    "SPLIT",
    "SPLIT_ANSWER",
]
