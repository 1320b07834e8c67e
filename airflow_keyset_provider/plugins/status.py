"""What the UI page shows, as JSON-safe dicts: streams, their rounds, ranges, lag and dead letters.

Everything here only *reads* Redis (``StreamControl`` / ``CursorStore`` reads and plain ``GET``,
``HMGET``, ``LRANGE``, ``SCAN``): the page is read-only by construction. It imports nothing from
Airflow, so it is testable against a bare Redis client.

The numbers are the CLI's (``airflow-keyset status``): one snapshot function serves both, so the
terminal and the browser never disagree about a round. On top of it this module adds what a page
needs and a terminal table does not:

- **lagging**: a range of an open round is lagging when it is not complete and either nobody owns
  it, or its owner's last heartbeat is older than twice the expected heartbeat interval. Workers
  renew a lease every third of its length, so the expected interval is ``lease / 3``, where the
  lease length is read back from the range itself (``lease_until - heartbeat_ms``, both written by
  the same heartbeat). ``lag_reason`` says which rule fired, in words.
- **progress basis**: ``progress`` is the key-space fraction of ``(lo, hi]`` the cursor has passed
  (interpolated on the first key column where ``lo`` and ``hi`` differ: integers, decimals, dates,
  timestamps, UUIDs, coarse for text). When no such number exists (``progress`` is ``None``) the
  page shows counts only; ``progress_basis`` tells the page which case it is.
- **dead letters**: per range, the count and the newest ``dead_limit`` entries (key, error,
  attempts, time).
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from ..cli import CliError, list_streams, round_snapshot, stream_snapshot
from ..core.control import StreamControl
from ..core.errors import ConfigurationError, RoundNotFoundError, RoundStateLostError
from ..core.keys import MIN_KEY, decode_key, display_key
from ..core.store import CursorStore

#: Heartbeats renew a lease every third of its length (see ``core.traversal._Heartbeat``).
HEARTBEATS_PER_LEASE = 3
#: A range is lagging when its heartbeat is older than this many expected intervals.
LAG_FACTOR = 2.0


class NotFound(LookupError):
    """No such stream or round under the configured key prefix (the message says which)."""


class StateLost(RuntimeError):
    """Redis no longer holds a round that was planned (flushed, evicted, restarted)."""


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else ("" if v is None else str(v))


def _control(client: Any, stream: str, prefix: str) -> StreamControl:
    try:
        return StreamControl(CursorStore(client, stream, prefix=prefix))
    except ConfigurationError as exc:  # an invalid stream name cannot exist
        raise NotFound(str(exc)) from exc


def _iso_ms(ms: int) -> str | None:
    if ms <= 0:
        return None
    return dt.datetime.fromtimestamp(ms / 1000, tz=dt.UTC).isoformat(timespec="seconds")


def streams(client: Any, prefix: str) -> list[dict[str, Any]]:
    """Every stream under ``prefix`` with its watermark, retention floor and open round ids."""
    return list_streams(client, prefix)


def stream_view(client: Any, prefix: str, stream: str, closed_limit: int = 3) -> dict[str, Any]:
    """The stream's watermark and retention floor, its open rounds (oldest first), then up to
    ``closed_limit`` most recent closed rounds (newest first). Round dicts carry the round's
    totals and progress but not its ranges (see :func:`round_view`)."""
    ctl = _control(client, stream, prefix)
    try:
        snap = stream_snapshot(ctl)
    except CliError as exc:
        raise NotFound(str(exc)) from exc
    except RoundStateLostError as exc:
        raise StateLost(str(exc)) from exc
    rounds = [_summary(ctl, r) for r in snap.pop("rounds")]
    rounds += [_summary(ctl, r)
               for r in _recent_closed(ctl, int(snap.get("rounds_planned") or 0), closed_limit)]
    snap["rounds"] = rounds
    return snap


def _recent_closed(ctl: StreamControl, planned: int, limit: int) -> list[dict[str, Any]]:
    """Snapshots of the newest closed rounds still in Redis (round ids are ``r1, r2, ...``)."""
    out: list[dict[str, Any]] = []
    n = planned
    while n > 0 and len(out) < limit and planned - n < 50:
        rid = f"r{n}"
        n -= 1
        if _s(ctl.store.client.hget(ctl.store.round_key(rid), "state")) != "closed":
            continue
        try:
            out.append(round_snapshot(ctl, rid))
        except (RoundStateLostError, RoundNotFoundError):
            continue  # deleted between the two reads
    return out


def _summary(ctl: StreamControl, rnd: dict[str, Any]) -> dict[str, Any]:
    keep = ("round_id", "state", "chained", "round_key", "created_at", "closed_at", "start_label",
            "end_label", "n_ranges", "ranges_complete", "done", "skipped", "dead", "retries", "items",
            "progress", "rate", "eta_s")
    out = {k: rnd.get(k) for k in keep}
    out["lagging"] = sum(1 for r in _with_lag(ctl, rnd) if r["lagging"])
    return out


def round_view(client: Any, prefix: str, stream: str, round_id: str, dead_limit: int = 3) -> dict[str, Any]:
    """One round with every range: bounds, cursor, progress, counters, owner, heartbeat,
    ``lagging`` / ``lag_reason`` and the newest ``dead_limit`` dead letters of each range."""
    ctl = _control(client, stream, prefix)
    try:
        rnd = round_snapshot(ctl, round_id)
    except RoundNotFoundError as exc:
        raise NotFound(str(exc)) from exc
    except RoundStateLostError as exc:
        raise StateLost(str(exc)) from exc
    rnd["ranges"] = _with_lag(ctl, rnd)
    rnd["lagging"] = sum(1 for r in rnd["ranges"] if r["lagging"])
    arity = len(decode_key(rnd["end_encoded"])) or 1
    for r in rnd["ranges"]:
        r["dead_letters"] = _dead_letters(ctl, round_id, r["range_id"], arity, dead_limit) if r["dead"] else []
    return rnd


def _lease_fields(ctl: StreamControl, round_id: str, n: int) -> list[tuple[int, int]]:
    """``(lease_until_ms, heartbeat_ms)`` per range, as the last claim/heartbeat wrote them."""
    pipe = ctl.store.client.pipeline(transaction=False)
    for i in range(n):
        pipe.hmget(ctl.store.range_key(round_id, i), "lease_until", "heartbeat_ms")
    out = []
    for lease_until, heartbeat in pipe.execute():
        out.append((int(_s(lease_until) or 0), int(_s(heartbeat) or 0)))
    return out


def _with_lag(ctl: StreamControl, rnd: dict[str, Any]) -> list[dict[str, Any]]:
    """Copies of the round's range rows with ``lagging``, ``lag_reason``,
    ``expected_heartbeat_s`` and ``progress_basis`` added."""
    raw = _lease_fields(ctl, rnd["round_id"], len(rnd["ranges"])) if rnd["state"] != "closed" \
        else [(0, 0)] * len(rnd["ranges"])
    out = []
    for r0, (lease_until, heartbeat) in zip(rnd["ranges"], raw, strict=True):
        r = dict(r0)
        lease_s = (lease_until - heartbeat) / 1000 if heartbeat and lease_until > heartbeat else None
        expected = lease_s / HEARTBEATS_PER_LEASE if lease_s else None
        r["expected_heartbeat_s"] = None if expected is None else round(expected, 1)
        r["lag_reason"] = lag_reason(rnd["state"], r, expected)
        r["lagging"] = r["lag_reason"] is not None
        r["progress_basis"] = ("complete" if r["state"] == "complete"
                               else "key space" if r.get("progress") is not None else "counts only")
        out.append(r)
    return out


def lag_reason(round_state: str, r: dict[str, Any], expected_heartbeat_s: float | None) -> str | None:
    """Why a range counts as lagging, or ``None`` when it does not (see the module docstring).

    A closed round and a complete range never lag. Otherwise: no owner -> lagging (never claimed,
    or released unfinished); an owner whose heartbeat is older than ``LAG_FACTOR`` expected
    intervals (or whose lease length cannot be read back) -> lagging."""
    if round_state == "closed" or r["state"] == "complete":
        return None
    age = r.get("heartbeat_age_s")
    if not r.get("owner"):
        if age is None:
            return "no owner: never claimed"
        return f"no owner: released unfinished, last heartbeat {_dur(age)} ago"
    if expected_heartbeat_s is None:
        return "owner without a readable lease"
    if age is None or age > LAG_FACTOR * expected_heartbeat_s:
        shown = "never" if age is None else f"{_dur(age)} ago"
        return f"stale owner: last heartbeat {shown}, expected every {_dur(expected_heartbeat_s)}"
    return None


def _dur(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s" if seconds >= 1 else f"{seconds:.1f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _dead_letters(ctl: StreamControl, round_id: str, range_id: int, arity: int, limit: int) -> list[dict[str, Any]]:
    out = []
    for d in ctl.store.dead_letters(round_id, range_id, limit):
        enc = _s(d.get("key"))
        try:
            label = display_key(enc, arity) if enc != MIN_KEY else "-inf"
        except Exception:  # a malformed entry is still worth showing
            label = enc
        out.append({"key_label": label, "error": _s(d.get("error")), "attempts": int(d.get("attempts") or 0),
                    "at": _iso_ms(int(d.get("at_ms") or 0))})
    return out
