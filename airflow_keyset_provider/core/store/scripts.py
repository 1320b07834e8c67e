"""The cursor store's Lua scripts, loaded from ``lua/*.lua`` (see ``cursor_store.py`` for the key
layout and the guarantees).

Each script is one file, ``lua/<name>.lua``, headed by a Lua comment block: what it does, the KEYS
it touches (all of one stream, sharing its hash tag), its ARGV and what it returns. Times come
from the Redis server's ``TIME``. The state strings are those of ``core/states.py``: rounds
``open``/``closed``/``unrecoverable``, ranges ``pending``/``running``/``complete``.

The fragments several scripts share live in ``lua/includes/``: ``now.lua`` (the server clock),
``intact.lua`` (the partial-loss check of a range), ``fields.lua`` and ``compact.lua`` (reading a
compact range hash, writing one anew: ``layout.py``). A script pulls one in with a line that is
exactly ``--!include <name>.lua``; the loader replaces that line with the fragment's text. An
include file opens with a comment block documenting the fragment (its leading ``--`` lines and
the blank line after them): that block is not pasted, so what a script runs is its own text plus
the fragments' code.

Every file is read once, when this module is imported (``importlib.resources``: the files ship
as package data), and each script is exposed as a string constant (``ADVANCE``, ``CLAIM``, ...).
The store registers them on its client (``StoreReads.script``: redis-py's ``Script``, EVALSHA,
loaded again on NOSCRIPT).
"""

from __future__ import annotations

import re
from importlib.resources import files

_INCLUDE = re.compile(r"^--!include (\S+)\n", re.MULTILINE)
_LUA = files(__package__) / "lua"


def _fragment(name: str) -> str:
    """An include file's code: its opening comment block (and the blank line after it) dropped."""
    lines = (_LUA / "includes" / name).read_text(encoding="utf-8").splitlines(keepends=True)
    i = 0
    while i < len(lines) and lines[i].startswith("--"):
        i += 1
    if i and i < len(lines) and lines[i] == "\n":
        i += 1
    return "".join(lines[i:])


def load(name: str) -> str:
    """The text of ``lua/<name>``, each ``--!include`` line replaced by its fragment's code (one
    level: a fragment includes nothing). Raises ``FileNotFoundError`` for a missing file and
    ``ValueError`` for a directive left in a fragment."""
    text = (_LUA / name).read_text(encoding="utf-8")
    out = _INCLUDE.sub(lambda m: _fragment(m.group(1)), text)
    if "--!include" in out:
        raise ValueError(f"lua/{name}: an --!include is not alone on its line, or is nested")
    return out


ADVANCE = load("advance.lua")
CLAIM = load("claim.lua")
CLOSE_ROUND = load("close_round.lua")
CREATE_ROUND = load("create_round.lua")
DELETE_ROUND = load("delete_round.lua")
FORWARD = load("forward.lua")
HEARTBEAT = load("heartbeat.lua")
MARK_UNRECOVERABLE = load("mark_unrecoverable.lua")
NEXT_UNCLAIMED = load("next_unclaimed.lua")
OPEN_BRIEFS = load("open_briefs.lua")
RAISE_COUNTER = load("raise_counter.lua")
REFRESH_TOTALS = load("refresh_totals.lua")
RELEASE = load("release.lua")
REQUEST_SPLIT = load("request_split.lua")
REQUEUE_DEAD = load("requeue_dead.lua")
RESTORE_ROUND = load("restore_round.lua")
SNAPSHOT_RANGES = load("snapshot_ranges.lua")
SPLIT = load("split.lua")
SPLIT_ANSWER = load("split_answer.lua")

__all__ = [
    "ADVANCE",
    "CLAIM",
    "CLOSE_ROUND",
    "CREATE_ROUND",
    "DELETE_ROUND",
    "FORWARD",
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
    "load",
]
