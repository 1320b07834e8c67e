"""One status model for rounds and ranges: named states, progress, rate, ETA and their wording.

The CLI, the Airflow UI page, the barrier and the engine's own errors all read a round through
these records (built by ``StreamControl``); none of them re-maps Redis hashes itself.

- **States** (:class:`RangeState`, :class:`RoundState`): the only values the store writes
  (defined in ``core/states.py``, re-exported here).
- **Progress** is measured in *key space*: a range's fraction is where its cursor sits between
  ``lo`` and ``hi`` on the first key column where they differ (integers, decimals, dates,
  timestamps, UUIDs; text coarsely by its first 8 bytes). Ranges are balanced by row count, so a
  round's fraction is the mean of its ranges'. ``None`` when no such number exists (the maths:
  ``core/rounds/progress.py``).
- **Rate and ETA** come from two readings (:meth:`RoundStatus.sampled`); a single reading has
  the round's average rate while processing (from its first claim to its last heartbeat, not
  from planning) and an ETA at that pace from the key-space progress. A range from ``-inf`` is
  measured from the round's lowest key when planned (its ``floor``), so the first round of a
  stream has a figure too, composite keys included.
- **Durations** are written by :func:`format_duration` (``45s``, ``1m05s``, ``2h03m``), in the
  terminal and in the browser page alike (the page's ``fmtDur`` mirrors it).
"""

from __future__ import annotations

import datetime as dt
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ..keys import MIN_KEY, display_key, to_json
from ..keys import decode_user_key as decode
from ..keys import key_label as value_label
from ..pace.stream_control import ControlState
from ..states import RangeState, RoundState, range_state, round_state
from .progress import key_eta, key_fraction
from .verify_record import VERIFICATION_FIELD, VERIFY_FIELD, Verification

# ---- wording shared by the terminal and the page ------------------------------------------


def format_duration(seconds: float | None) -> str:
    """``None`` -> ``-``; ``45s``, ``1m05s``, ``2h03m`` (rounded half up to the second, as the
    page's ``Math.round``)."""
    if seconds is None:
        return "-"
    s = math.floor(seconds + 0.5)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def format_rate(rate: float | None) -> str:
    """Items per second: ``-``, ``2.5/s``, ``340/s``, ``12k/s``."""
    if rate is None:
        return "-"
    if rate >= 10_000:
        return f"{rate / 1000:,.0f}k/s"
    return f"{rate:,.0f}/s" if rate >= 10 else f"{rate:.1f}/s"


def iso_ms(ms: Any) -> str | None:
    """A Redis-clock millisecond timestamp as ISO 8601 UTC (``None`` for 0 or garbage)."""
    try:
        n = int(ms)
    except (TypeError, ValueError):
        return None
    if n <= 0:
        return None
    return dt.datetime.fromtimestamp(n / 1000, tz=dt.UTC).isoformat(timespec="seconds")


# ---- records --------------------------------------------------------------------------------


@dataclass(frozen=True)
class RangeStatus:
    """One range as read from the store (one Redis hash), times on the Redis server's clock.

    ``record["field"]`` / ``record.get("field")`` read an attribute, for code written against
    the dicts ``StreamControl.range_status`` returned before (same names, same values)."""

    range_id: int
    state: str
    lo_encoded: str
    hi_encoded: str
    cursor_encoded: str
    arity: int = 1
    owner: str = ""
    lease_left_s: float = 0.0
    heartbeat_age_s: float | None = None
    done: int = 0
    skipped: int = 0
    dead: int = 0
    retries: int = 0
    takeovers: int = 0
    chunks: int = 0
    claimed_ms: int = 0
    completed_ms: int = 0
    heartbeat_ms: int = 0
    lease_until_ms: int = 0
    rate: float | None = None  #: items/s between two readings (see ``RoundStatus.sampled``)
    eta_s: float | None = None  #: seconds to ``hi`` at the sampled key-space velocity
    #: the range a pull task coalesced this one into when it claimed it (this one is then empty
    #: and complete, its keys that range's); None otherwise
    merged_into: int | None = None
    #: the round's lowest key when it was planned (its ``floor``): where a range from ``-inf``
    #: starts on the key axis, so its progress has a figure ("" when not recorded)
    floor_encoded: str = ""

    @classmethod
    def from_hash(cls, h: dict[str, str], arity: int, now_ms: int, floor: str = "") -> RangeStatus:
        """From the store's range hash (``StreamControl`` reads it); ``floor`` the round's."""
        hb = int(h.get("heartbeat_ms") or 0)
        lease = int(h.get("lease_until") or 0)
        owner = h.get("owner", "")
        return cls(
            range_id=int(h["range_id"]),
            state=range_state(h["state"]),
            lo_encoded=h["lo"],
            hi_encoded=h["hi"],
            cursor_encoded=h["cursor"],
            arity=arity,
            owner=owner,
            lease_left_s=max(lease - now_ms, 0) / 1000 if owner else 0.0,
            heartbeat_age_s=(now_ms - hb) / 1000 if hb else None,
            done=int(h["done"]),
            skipped=int(h["skipped"]),
            dead=int(h["dead"]),
            retries=int(h.get("retries") or 0),
            takeovers=int(h.get("takeovers") or 0),
            chunks=int(h.get("chunks") or 0),
            claimed_ms=int(h.get("claimed_ms") or 0),
            completed_ms=int(h.get("completed_ms") or 0),
            heartbeat_ms=hb,
            lease_until_ms=lease,
            merged_into=int(h["merged_into"]) if h.get("merged_into") else None,
            floor_encoded=floor if h["lo"] == MIN_KEY else "",
        )

    # ---- derived facts
    lo = property(lambda self: decode(self.lo_encoded, self.arity))
    hi = property(lambda self: decode(self.hi_encoded, self.arity))
    cursor = property(lambda self: decode(self.cursor_encoded, self.arity))
    lo_label = property(lambda self: display_key(self.lo_encoded, self.arity))
    hi_label = property(lambda self: display_key(self.hi_encoded, self.arity))
    cursor_label = property(lambda self: display_key(self.cursor_encoded, self.arity))

    @property
    def items(self) -> int:
        """Items that reached a terminal state: done + skipped + dead."""
        return self.done + self.skipped + self.dead

    @property
    def complete(self) -> bool:
        return self.state == RangeState.COMPLETE

    @property
    def progress(self) -> float | None:
        """Key-space fraction of the cursor in ``(lo, hi]``; a range from ``-inf`` is measured
        from the round's lowest key when planned (``floor_encoded``), as rows below it did not
        exist then."""
        lo, cursor = self.lo_encoded, self.cursor_encoded
        if lo == MIN_KEY and self.floor_encoded and cursor != MIN_KEY:
            lo = min(self.floor_encoded, cursor)
            if cursor == lo:  # at the first key: one row in, the axis has no length yet
                return 0.0 if not self.complete else 1.0
        return key_fraction(lo, self.hi_encoded, cursor, complete=self.complete)

    @property
    def lease_s(self) -> float | None:
        """The lease length its owner asked for (the last claim or heartbeat wrote both ends)."""
        hb, until = self.heartbeat_ms, self.lease_until_ms
        return (until - hb) / 1000 if hb and until > hb else None

    def __getitem__(self, name: str) -> Any:
        try:
            return getattr(self, name)
        except AttributeError:
            raise KeyError(name) from None

    def get(self, name: str, default: Any = None) -> Any:
        return getattr(self, name, default)

    def describe(self) -> str:
        """One line for logs and errors about a lagging range."""
        owner = self.owner or "no owner"
        hb = self.heartbeat_age_s
        beat = f"last heartbeat {hb:.0f} s ago" if hb is not None else "never claimed"
        return (
            f"range {self.range_id} at {self.cursor_label} of {self.hi_label} ({self.state}, {owner}, "
            f"{beat}, retry {self.retries})"
        )

    def as_dict(self) -> dict[str, Any]:
        """JSON-safe: the row of ``airflow-keyset status --json`` and of the page's API."""
        hb = self.heartbeat_age_s
        return {
            "range_id": self.range_id,
            "state": str(self.state),
            "lo": to_json(self.lo),
            "hi": to_json(self.hi),
            "cursor": to_json(self.cursor),
            "lo_label": self.lo_label,
            "hi_label": self.hi_label,
            "cursor_label": self.cursor_label,
            "lo_encoded": self.lo_encoded,
            "hi_encoded": self.hi_encoded,
            "cursor_encoded": self.cursor_encoded,
            "owner": self.owner,
            "lease_left_s": round(self.lease_left_s, 1),
            "heartbeat_age_s": None if hb is None else round(hb, 1),
            "claimed_at": iso_ms(self.claimed_ms),
            "completed_at": iso_ms(self.completed_ms),
            "done": self.done,
            "skipped": self.skipped,
            "dead": self.dead,
            "items": self.items,
            "retries": self.retries,
            "takeovers": self.takeovers,
            "chunks": self.chunks,
            "progress": self.progress,
            "rate": self.rate,
            "eta_s": self.eta_s,
            "merged_into": self.merged_into,
        }

    def sampled(self, before: RangeStatus, seconds: float) -> RangeStatus:
        """This reading with ``rate`` and ``eta_s`` from an earlier reading ``seconds`` before."""
        rate = max(self.items - before.items, 0) / seconds
        eta = (
            0.0
            if self.complete
            else key_eta(
                self.lo_encoded,
                self.hi_encoded,
                before.cursor_encoded,
                self.cursor_encoded,
                seconds,
            )
        )
        return replace(self, rate=rate, eta_s=eta)


@dataclass(frozen=True)
class RoundStatus:
    """One round and its ranges. ``rate`` is the average since planned until ``sampled``."""

    stream: str
    round_id: str
    state: str
    start_encoded: str
    end_encoded: str
    arity: int = 1
    chained: bool = False
    round_key: str | None = None
    created_ms: int = 0
    closed_ms: int = 0
    source: Any = None
    ranges: tuple[RangeStatus, ...] = ()
    rate: float | None = None
    eta_s: float | None = None
    rate_basis: str | None = None
    #: the round's ``verify`` predicate (the DAG author's SQL, as planned); None: no verification
    verify: str | None = None
    #: the last verification's result (``core/rounds/verification.py``); None: not run yet
    verification: Verification | None = None

    @classmethod
    def from_info(
        cls, stream: str, round_id: str, info: dict[str, str], ranges: Sequence[RangeStatus]
    ) -> RoundStatus:
        """From the store's round hash and the round's ranges, with the average rate since planned."""
        created = int(info.get("created_ms") or 0)
        closed = int(info.get("closed_ms") or 0)
        # processing, not waiting: from the round's first claim (planned rounds may wait hours
        # for their tasks) to its last heartbeat or completion (not the close: the barrier may
        # poll long after the last range finished)
        began = int(info.get("first_claim_ms") or 0)
        items = sum(r.items for r in ranges)
        last = max([r.heartbeat_ms for r in ranges] + [r.completed_ms for r in ranges] + [0])
        if info["state"] == RoundState.CLOSED and not began:
            last = closed or last
        start = began or created
        elapsed = (last - start) / 1000 if start and last > start else None
        rate = items / elapsed if elapsed and items else None
        basis = "average while processing" if began else "average since planned"
        rnd = cls(
            stream=stream,
            round_id=round_id,
            state=round_state(info["state"]),
            start_encoded=info["start"],
            end_encoded=info["end"],
            arity=int(info.get("arity") or 1),
            chained=info.get("chained") == "1",
            round_key=info.get("round_key") or None,
            created_ms=created,
            closed_ms=closed,
            source=_source(info.get("source")),
            ranges=tuple(ranges),
            rate=rate,
            rate_basis=basis if rate is not None else None,
            verify=info.get(VERIFY_FIELD),
            verification=Verification.from_record(
                info.get(VERIFICATION_FIELD), int(info.get("arity") or 1)
            ),
        )
        p = rnd.progress
        if began and elapsed and not rnd.closed and p is not None and 0 < p < 1:
            # the rest at the pace so far (key space per processing second); a sampled reading
            # (``sampled``) replaces it with the current pace
            rnd = replace(rnd, eta_s=elapsed * (1 - p) / p)
        return rnd

    start_key = property(lambda self: decode(self.start_encoded, self.arity))
    end_key = property(lambda self: decode(self.end_encoded, self.arity))
    start_label = property(lambda self: display_key(self.start_encoded, self.arity))
    end_label = property(lambda self: display_key(self.end_encoded, self.arity))
    created_at = property(lambda self: iso_ms(self.created_ms))
    closed_at = property(lambda self: iso_ms(self.closed_ms))
    n_ranges = property(lambda self: len(self.ranges))
    ranges_complete = property(lambda self: sum(r.complete for r in self.ranges))
    done = property(lambda self: sum(r.done for r in self.ranges))
    skipped = property(lambda self: sum(r.skipped for r in self.ranges))
    dead = property(lambda self: sum(r.dead for r in self.ranges))
    retries = property(lambda self: sum(r.retries for r in self.ranges))
    items = property(lambda self: sum(r.items for r in self.ranges))
    #: ranges coalesced into a neighbour (empty and complete; counted in ``ranges_complete``)
    ranges_merged = property(lambda self: sum(r.merged_into is not None for r in self.ranges))

    @property
    def in_key_order(self) -> tuple[RangeStatus, ...]:
        """The ranges sorted by ``lo``, then ``hi`` (``ranges`` is in id order; a split appends a
        range whose keys sit inside its parent's old bounds, so ids are not in key order after
        one; a coalesced range is empty at its host's end, right after the host)."""
        return tuple(sorted(self.ranges, key=lambda r: (r.lo_encoded, r.hi_encoded, r.range_id)))

    @property
    def closed(self) -> bool:
        return self.state == RoundState.CLOSED

    @property
    def verification_text(self) -> str | None:
        """One line for the terminal: None without ``verify``; ``pending`` before it ran; else
        ``Verification.describe`` (the state, counts and first keys; never row data)."""
        if self.verification is not None:
            return self.verification.describe()
        return None if self.verify is None else "pending (the barrier verifies before closing)"

    @property
    def verification_dict(self) -> dict[str, Any] | None:
        """The verification as the CLI, the page and the barrier show it: None without a
        ``verify`` predicate; ``{"state": "pending"}`` before it ran; else the result."""
        if self.verification is not None:
            return self.verification.as_dict()
        return None if self.verify is None else {"state": "pending"}

    @property
    def unfinished(self) -> bool:
        """Not closed and some range not complete (what ``--check`` exits 3 for)."""
        return not self.closed and self.ranges_complete < self.n_ranges

    @property
    def progress(self) -> float | None:
        """1.0 once closed, else the mean of the ranges' fractions (None if one has none); a
        range coalesced into another (empty) does not count."""
        if self.closed:
            return 1.0
        fractions = [r.progress for r in self.ranges if r.merged_into is None]
        if not fractions or None in fractions:
            return None
        return sum(f for f in fractions if f is not None) / len(fractions)

    def sampled(self, before: RoundStatus, seconds: float) -> RoundStatus:
        """This reading with per-range and round ``rate``/``eta_s`` from a reading of the same
        round ``seconds`` earlier (the round's ETA is its slowest range's; None while a running
        range does not move). Returned unchanged for another round or ``seconds <= 0``."""
        if seconds <= 0 or before.round_id != self.round_id:
            return self
        old = {r.range_id: r for r in before.ranges}
        ranges = [
            r.sampled(old[r.range_id], seconds) if r.range_id in old else r for r in self.ranges
        ]
        rate = sum(r.rate or 0.0 for r in ranges)
        running = [r for r in ranges if not r.complete]
        etas = [r.eta_s for r in running if r.eta_s is not None]
        eta = max(etas) if running and len(etas) == len(running) else (0.0 if not running else None)
        return replace(
            self,
            ranges=tuple(ranges),
            rate=rate,
            eta_s=eta,
            rate_basis=f"sampled over {seconds:g} s",
        )

    def as_dict(self) -> dict[str, Any]:
        """JSON-safe: the round of ``airflow-keyset status --json`` and of the page's API."""
        return {
            "stream": self.stream,
            "round_id": self.round_id,
            "state": str(self.state),
            "chained": self.chained,
            "round_key": self.round_key,
            "created_at": self.created_at,
            "closed_at": self.closed_at,
            "start_key": to_json(self.start_key),
            "end_key": to_json(self.end_key),
            "start_label": self.start_label,
            "end_label": self.end_label,
            "start_encoded": self.start_encoded,
            "end_encoded": self.end_encoded,
            "source": self.source,
            "n_ranges": self.n_ranges,
            "ranges_complete": self.ranges_complete,
            "ranges_merged": self.ranges_merged,
            "done": self.done,
            "skipped": self.skipped,
            "dead": self.dead,
            "retries": self.retries,
            "items": self.items,
            "progress": self.progress,
            "rate": self.rate,
            "eta_s": self.eta_s,
            "rate_basis": self.rate_basis,
            "verification": self.verification_dict,
            "ranges": [r.as_dict() for r in self.ranges],
        }


@dataclass(frozen=True)
class StreamStatus:
    """A stream's watermark, retention floor, round counter and the rounds asked for."""

    stream: str
    key_prefix: str
    watermark_encoded: str | None
    arity: int
    retention_floor: Any
    rounds_planned: int
    open_rounds: tuple[str, ...] = ()
    rounds: tuple[RoundStatus, ...] = field(default=())
    control: ControlState = field(default_factory=ControlState)  # pause and throughput budget

    @property
    def watermark(self) -> Any:
        wm = self.watermark_encoded
        return decode(wm, self.arity) if wm else None

    @property
    def watermark_label(self) -> str | None:
        wm = self.watermark_encoded
        return display_key(wm, self.arity) if wm else None

    @property
    def retention_floor_label(self) -> str | None:
        floor = self.retention_floor
        return value_label(floor) if floor is not None else None

    @property
    def unfinished(self) -> bool:
        """Some shown round is open with ranges not complete."""
        return any(r.unfinished for r in self.rounds)

    def sampled(self, before: StreamStatus, seconds: float) -> StreamStatus:
        """This reading with each round's rates and ETAs from ``before`` (``seconds`` earlier)."""
        old = {r.round_id: r for r in before.rounds}
        rounds = tuple(
            r.sampled(old[r.round_id], seconds) if r.round_id in old else r for r in self.rounds
        )
        return replace(self, rounds=rounds)

    def as_dict(self, *, with_rounds: bool = True) -> dict[str, Any]:
        """JSON-safe: ``airflow-keyset status STREAM --json`` (without ``rounds``: one entry of
        ``airflow-keyset status --json``)."""
        out: dict[str, Any] = {
            "stream": self.stream,
            "key_prefix": self.key_prefix,
            "watermark": to_json(self.watermark),
            "watermark_label": self.watermark_label,
            "retention_floor": to_json(self.retention_floor),
            "retention_floor_label": self.retention_floor_label,
            "rounds_planned": self.rounds_planned,
            "open_rounds": list(self.open_rounds),
            "control": self.control.as_dict(),
        }
        if with_rounds:
            out["rounds"] = [r.as_dict() for r in self.rounds]
        return out


def _source(raw: str | None) -> Any:
    try:
        return json.loads(raw) if raw else None
    except ValueError:
        return raw
