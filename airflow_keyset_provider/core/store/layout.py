"""A range hash holds only the fields that are not at their default (issue #11: a round of 4,096
ranges stays under 1 MB of Redis at every stage, ``tests/core/store/test_redis_footprint.py``).

- A range is created with ``lo``, ``hi``, ``cursor``, ``state``, ``dead`` and ``retries`` (these two
  always: they are what partial-loss detection compares, ``lua/includes/intact.lua``).
- Its owner's claim, heartbeats and commits add the other fields.
- When its owner releases a *complete* range (or the next claim finds a complete range whose owner
  died), the hash is written anew with only ``lo``, ``hi``, ``state``, ``retries``, ``dead``,
  ``completed_ms`` and the counters that are not 0 (``compact``, ``lua/includes/compact.lua``,
  whose ``DROP`` and ``DROP_ZERO`` tables name what goes): its owner token, lineage, lease,
  cursor (= ``hi``), epoch, claim time and split request go. No owner acts on a complete range: a
  late advance or heartbeat of the old token is refused, as before, for not being the owner.
  Written anew because a hash that once held a long value (an owner token, a lineage) keeps
  Redis's large encoding when fields are only deleted.

Every reader fills the defaults in: the scripts with ``fields`` (``lua/includes/fields.lua``),
Python with ``range_fields``; both from the same defaults (``RANGE_DEFAULTS`` here and its copy in
``fields.lua``: ``tests/core/store/test_store_scripts.py`` checks they agree). A missing ``cursor`` is
``hi`` once the range is complete (a range completes only at ``hi``), else ``lo``. A hash written
by an older version holds every field and reads the same.
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


def range_fields(h: dict[str, str]) -> dict[str, str]:
    """A range hash as read, with every field a compact hash leaves out filled in (a hash written
    by an older version holds them all and comes back unchanged); ``{}`` stays ``{}``."""
    if not h:
        return h
    out = {**RANGE_DEFAULTS, **h}
    if "cursor" not in h:
        out["cursor"] = h.get("hi", "") if out["state"] == "complete" else h.get("lo", "")
    return out
