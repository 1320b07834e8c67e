"""Lua fragments the cursor store's scripts prepend (``store_scripts.py``): the server clock
(``now``), the intactness check of a range (``intact``) and the reading of a range hash whose
fields at their default may be missing (``fields``, ``compact``: ``store_layout.py``)."""

from __future__ import annotations

from .layout import COMPACT_LUA, FIELDS_LUA

_NOW = "local t = redis.call('TIME'); local now = t[1] * 1000 + math.floor(t[2] / 1000)\n"

# A range is intact when its hash exists and the counts it keeps beside what they count agree:
# ``retries`` = HLEN of its retry hash, ``dead`` = LLEN of its dead list (every script that
# changes one changes the other in the same step). A piece evicted or deleted on its own (one
# retry hash, one dead list) breaks the equality and reads as lost, never as "nothing left".
# A range written before the counts were kept (no ``retries`` field) is checked for existence only.
_INTACT = """
local function intact(range, retry, dead)
  if redis.call('EXISTS', range) == 0 then return false end
  local c = redis.call('HMGET', range, 'retries', 'dead')
  if not c[1] then return true end
  return tonumber(c[1]) == redis.call('HLEN', retry) and tonumber(c[2]) == redis.call('LLEN', dead)
end
"""

# Range fields at their default may be missing: every script that reads a range's fields reads
# them with ``fields`` (defaults filled in); RELEASE and CLAIM ``compact`` a complete range
# (``store_layout.py``).
_FIELDS = FIELDS_LUA + COMPACT_LUA
