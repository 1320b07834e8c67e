"""A range hash holds only the fields that are not at their default (issue #11: a round of 4,096
ranges stays under 1 MB of Redis at every stage, ``tests/core/test_redis_footprint.py``).

- A range is created with ``lo``, ``hi``, ``cursor``, ``state``, ``dead`` and ``retries`` (these two
  always: they are what partial-loss detection compares, ``intact`` in ``store_lua.py``).
- Its owner's claim, heartbeats and commits add the other fields.
- When its owner releases a *complete* range (or the next claim finds a complete range whose owner
  died), the hash is written anew with only ``lo``, ``hi``, ``state``, ``retries``, ``dead``,
  ``completed_ms`` and the counters that are not 0 (``COMPACT_LUA``): its owner token, lineage,
  lease, cursor (= ``hi``), epoch, claim time and split request go. No owner acts on a complete
  range: a late advance or heartbeat of the old token is refused, as before, for not being the
  owner. Written anew because a hash that once held a long value (an owner token, a lineage)
  keeps Redis's large encoding when fields are only deleted.

Every reader fills the defaults in: the scripts with ``fields`` (``FIELDS_LUA``), Python with
``range_fields``; both from ``RANGE_DEFAULTS``. A missing ``cursor`` is ``hi`` once the range is
complete (a range completes only at ``hi``), else ``lo``. A hash written by an older version holds
every field and reads the same.
"""

from __future__ import annotations

#: The value of each range field a hash may leave out.
RANGE_DEFAULTS: dict[str, str] = {
    "owner": "",
    "lineage": "",
    "epoch": "0",
    "lease_until": "0",
    "heartbeat_ms": "0",
    "claimed_ms": "0",
    "completed_ms": "0",
    "done": "0",
    "skipped": "0",
    "dead": "0",
    "retries": "0",
    "takeovers": "0",
    "chunks": "0",
    "state": "pending",
}
#: What a complete range drops when compacted, and the counters it drops when they are 0.
COMPACT_DROPS = (
    "owner",
    "lineage",
    "lease_until",
    "heartbeat_ms",
    "cursor",
    "epoch",
    "claimed_ms",
    "split_req",
    "split_req_ms",
    "split_answer",
    "split_from",
    "created_ms",
)
COMPACT_DROPS_AT_ZERO = ("done", "skipped", "takeovers", "chunks")


def range_fields(h: dict[str, str]) -> dict[str, str]:
    """A range hash as read, with every field a compact hash leaves out filled in (a hash written
    by an older version holds them all and comes back unchanged); ``{}`` stays ``{}``."""
    if not h:
        return h
    out = {**RANGE_DEFAULTS, **h}
    if "cursor" not in h:
        out["cursor"] = h.get("hi", "") if out["state"] == "complete" else h.get("lo", "")
    return out


def _lua_table(items: dict[str, str]) -> str:
    return "{" + ", ".join(f"{k} = '{v}'" for k, v in items.items()) + "}"


# ``fields(key, name, ...)``: the named fields of a range hash, defaults filled in (one HMGET).
FIELDS_LUA = (
    f"local RANGE_DEFAULTS = {_lua_table(RANGE_DEFAULTS)}\n"
    + """local function fields(key, ...)
  local names = {...}
  local r = redis.call('HMGET', key, 'state', 'lo', 'hi', unpack(names))
  local out = {}
  for i, name in ipairs(names) do
    local v = r[3 + i]
    if not v and name == 'cursor' then
      if r[1] == 'complete' then v = r[3] else v = r[2] end
    elseif not v then
      v = RANGE_DEFAULTS[name]
    end
    out[i] = v
  end
  return out
end
"""
)

# ``compact(key)``: write a complete range's hash anew without its owner's fields.
COMPACT_LUA = (
    f"local DROP = {_lua_table(dict.fromkeys(COMPACT_DROPS, '1'))}\n"
    f"local DROP_ZERO = {_lua_table(dict.fromkeys(COMPACT_DROPS_AT_ZERO, '1'))}\n"
    + """local function compact(key)
  local h = redis.call('HGETALL', key)
  local keep = {}
  for i = 1, #h, 2 do
    if not DROP[h[i]] and not (DROP_ZERO[h[i]] and h[i + 1] == '0') then
      table.insert(keep, h[i])
      table.insert(keep, h[i + 1])
    end
  end
  redis.call('DEL', key)
  redis.call('HSET', key, unpack(keep))
end
"""
)
