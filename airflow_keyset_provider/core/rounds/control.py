"""Reading and closing rounds of a stream: everything that needs Redis but not the source.

Used by the barrier (sensor and trigger), the CLI and the UI, none of which need a database
connection to answer "how far is this round?" or to close it. Status is read into the records
of ``core/rounds/status.py`` (``stream_status``, ``round_status``, ``range_status``), the one model every
reader renders.

What each reader sees (the reads are ``StoreReads.ranges``: batches of ranges, pipelined, so a
status read of thousands of ranges never holds Redis for more than one small script):

- ``round_status`` / ``range_status`` / ``stream_status`` (CLI, UI page): each range read
  atomically with its retry and dead-letter counts (checked intact), the ranges of a round not at
  one instant; they cover the round even while ranges are split.
- ``check_round`` (the barrier's poll): the same read; ``complete`` only says that ``close_round``
  is worth calling. ``close_round`` alone decides, in one script over every range (coverage with
  no gap, every range complete): it runs once per round, when the batched read saw it complete.
- the checkpoint mirror (``_mirror_round``, at plan and close): each range with its retry
  entries and dead letters in one script call (``snapshot_ranges``), ranges not at one instant:
  the mirror's guarantee is per range (a mirrored cursor is never ahead of its committed one).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from ..errors import (
    ConfigurationError,
    RetentionError,
    RoundIncompleteError,
    RoundStateLostError,
    StreamNotFoundError,
)
from ..keys import MIN_KEY, decode_key, decode_user_key, display_key, from_tuple, to_json
from ..pace.stream_control import ControlState, StreamSwitch
from ..store.cursor_store import Closed, CursorStore, Gap, Unrecoverable
from ..store.reads import stream_names
from .durability import round_number
from .mirror import CheckpointMirror
from .regressions import (
    closed_by_mirror,
    cover_lost_ranges,
    end_overlaps,
    reconcile,
)
from .status import RangeState, RangeStatus, RoundState, RoundStatus, StreamStatus

log = logging.getLogger("airflow_keyset_provider")

T = TypeVar("T")


@dataclass(frozen=True)
class RangeSpec:
    range_id: int
    lo: Any  # None stands for "no lower bound" (-inf)
    hi: Any
    lo_encoded: str
    hi_encoded: str
    label: str


@dataclass(frozen=True)
class Round:
    round_id: str
    stream: str
    start_key: Any
    end_key: Any
    ranges: list[RangeSpec]
    start_encoded: str
    end_encoded: str
    state: str
    created: bool = False  # True when this plan call created the round


@dataclass(frozen=True)
class RoundTotals:
    round_id: str
    start_key: Any
    end_key: Any
    done: int
    skipped: int
    dead: int
    watermark: Any = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "round_id": self.round_id,
            "start_key": to_json(self.start_key),
            "end_key": to_json(self.end_key),
            "done": self.done,
            "skipped": self.skipped,
            "dead": self.dead,
            "watermark": to_json(self.watermark),
        }


@dataclass(frozen=True)
class RoundCheck:
    """A read-only look at a round: ``complete`` is true when every range is complete (the close
    itself re-checks coverage atomically)."""

    round_id: str
    state: str
    complete: bool
    lagging: list[RangeStatus]


class StreamControl:
    """Round-level operations on one stream's control state in Redis."""

    def __init__(self, store: CursorStore, mirror: CheckpointMirror | None = None) -> None:
        self.store = store
        self.stream = store.stream
        self.mirror = mirror

    # ---- durable mirror ----------------------------------------------------------------------
    def restore(self, round_id: str) -> bool:
        """Rebuild a round that Redis lost from the checkpoint mirror. Returns False when there is
        no mirror or it never saw the round (the loss then stays an error)."""
        doc = self.mirror.load_round(self.stream, round_id) if self.mirror else None
        if doc is None:
            return False
        if round_number(round_id) > (self.store.round_counter() or 0):
            # Redis never heard of it (it lost the stream, or went back to a lagging replica):
            # restoring it alone would move the round counter past the other rounds it lost,
            # and the next plan would take those for rounds removed on purpose (an open chained
            # round left unrestored, its chained plan a new round). Every round above the
            # counter is restored first (``reconcile``: the counter moves once, past all).
            self.recover_stream()
            if self.store.round_state(round_id) is not None:
                return True
        info, ranges = doc
        # splits append ranges: never restore fewer than the mirror holds (two owners' split
        # records may land in either order)
        n = max([int(info.get("n_ranges") or 0), *(int(r["range_id"]) + 1 for r in ranges)])
        skips = {k for k in info if k.startswith("skip:")}
        fixed = end_overlaps(round_id, info, ranges)  # a split or a coalescing the mirror missed
        # a range the round counts but the mirror has no record of, or keys none covers: rebuilt
        # (when Redis keeps the round, its n_ranges stays: only its lost ids are rebuilt)
        kept = self.store.round_state(round_id) is not None
        if kept:
            n = int(self.store.round_info(round_id)["n_ranges"])
            counted = [r for r in ranges if int(r["range_id"]) < n]
            _, rebuilt = cover_lost_ranges(round_id, info, counted, n)
            rebuilt = [r for r in rebuilt if int(r["range_id"]) < n]
            ranges += rebuilt
        else:
            n, rebuilt = cover_lost_ranges(round_id, info, ranges, n)
        info = {**info, "n_ranges": str(n)}
        if skips - set(info):  # a coalescing hint the repair took back: the mirror's too
            self.mirror.save_round(self.stream, round_id, info, [])  # type: ignore[union-attr]
        for r in fixed + rebuilt:  # written back: the mirror is a partition
            self.mirror.save_range(self.stream, round_id, int(r["range_id"]), r)  # type: ignore[union-attr]
        if self.store.restore_round(info, ranges):
            arity = self._arity(info)
            log.warning(
                "round %s of stream %s: Redis lost (part of) its state; restored from the "
                "checkpoint mirror",
                round_id,
                self.stream,
            )
            for r in ranges:
                log.warning(
                    "round %s range %s as the checkpoint mirror holds it: cursor %s, done %s, "
                    "skipped %s, dead %s, %d retry, state %s; a range rebuilt from it delivers the "
                    "keys committed after that cursor again (at-least-once)",
                    round_id,
                    r["range_id"],
                    display_key(r["cursor"], arity),
                    r["done"],
                    r["skipped"],
                    r["dead"],
                    len(r.get("retry") or {}),
                    r["state"],
                )
        return True

    def restoring(self, round_id: str, read: Callable[[], T]) -> T:
        """``read()``; if Redis lost (part of) the round, restore it from the checkpoint mirror
        and ``read()`` again. The one path the barrier's check and the close share: without a
        mirror, or when the mirror never saw the round, ``RoundStateLostError`` is raised."""
        try:
            return read()
        except RoundStateLostError:
            if not self.restore(round_id):
                raise
        return read()

    def recover_stream(self) -> None:
        """If Redis lost the stream (no round counter), or went back in time (a failover to a
        lagging replica), but the mirror knows it: put back the watermark, the fingerprint of the
        key it is encoded with, the round counter and the rounds Redis lost
        (``core/rounds/regressions.py``)."""
        if self.mirror is None:
            return
        reconcile(self)
        key = self.mirror.load_key_fingerprint(self.stream)
        if key is not None:  # the key that watermark is encoded with (core/rounds/stream_key.py)
            self.store.record_key_fingerprint(key)  # SET NX: never overwrites

    def _mirror_round(self, round_id: str) -> int:
        """Record the round and its ranges in the mirror; returns the ``n_ranges`` recorded."""
        if self.mirror is None:
            return 0
        info = self.store.round_info(round_id)
        ranges = self.store.snapshot_ranges(round_id, range(int(info["n_ranges"])))
        self.mirror.save_round(self.stream, round_id, info, ranges)
        return int(info["n_ranges"])

    def _arity(self, info: dict[str, str]) -> int:
        return int(info.get("arity", "1"))

    def round(self, round_id: str) -> Round:
        info = self.store.round_info(round_id)
        arity = self._arity(info)
        ranges = self.store.ranges(round_id, int(info["n_ranges"]))
        specs = [
            RangeSpec(
                range_id=int(r["range_id"]),
                lo=decode_user_key(r["lo"], arity),
                hi=decode_user_key(r["hi"], arity),
                lo_encoded=r["lo"],
                hi_encoded=r["hi"],
                label=(
                    f"range {r['range_id']} ({display_key(r['lo'], arity)}, "
                    f"{display_key(r['hi'], arity)}]"
                ),
            )
            for r in ranges
        ]
        return Round(
            round_id,
            self.stream,
            decode_user_key(info["start"], arity),
            decode_user_key(info["end"], arity),
            specs,
            info["start"],
            info["end"],
            info["state"],
        )

    def watermark(self) -> Any:
        """The end of the stream's contiguous completed prefix (None before the first round)."""
        wm = self.store.watermark()
        if wm is None:
            return None
        return from_tuple(decode_key(wm), len(decode_key(wm)))

    def retention_floor(self, open_rounds: Sequence[RoundStatus] | None = None) -> Any:
        """The highest key at or below which the source may delete rows without harming any round
        (None: keep everything). It is the lowest of: each incomplete range's cursor (its ``lo``
        while it has items waiting for a retry, which are re-read by key), and the watermark unless
        a chained round is open (the next chained round starts there). ``open_rounds``: the
        stream's open rounds as just read (else they are read here). The ranges are read in
        batches (``StoreReads.ranges``): they cover each round, so the floor is never above a key
        some range still has to read."""
        candidates: list[str] = []
        chained_open = self.store.lookup(None, chained=True)
        if open_rounds is None:
            open_rounds = [self.round_status(rid) for rid in self.store.open_rounds()]
        for rnd in open_rounds:
            for r in rnd.ranges:
                if r.state != RangeState.COMPLETE:
                    candidates.append(r.lo_encoded if r.retries else r.cursor_encoded)
        if chained_open is None:
            candidates.append(self.store.watermark() or MIN_KEY)
        floor = min(candidates) if candidates else MIN_KEY
        if floor == MIN_KEY:
            return None
        values = decode_key(floor)
        return from_tuple(values, len(values))

    def open_rounds(self) -> list[str]:
        return self.store.open_rounds()

    def range_status(self, round_id: str) -> list[RangeStatus]:
        """Every range of the round as a ``RangeStatus`` (one pipelined read of batches), lease
        and heartbeat ages on the Redis server's clock."""
        return list(self.round_status(round_id).ranges)

    def round_status(self, round_id: str) -> RoundStatus:
        """The round and its ranges as one ``RoundStatus`` (average rate since planned); the
        ranges in id order, each read atomically, not all at one instant (module docstring)."""
        info = self.store.round_info(round_id)
        arity = self._arity(info)
        now_ms = self._now_ms()
        floor = info.get("floor", "")
        ranges = [
            RangeStatus.from_hash(r, arity, now_ms, floor)
            for r in self.store.ranges(round_id, int(info["n_ranges"]))
        ]
        return RoundStatus.from_info(self.stream, round_id, info, ranges)

    def require_stream(self) -> None:
        """Raise ``StreamNotFoundError`` when the stream has no state at all (never planned, a
        typo, or a Redis that lost everything)."""
        if not self.store.has_state():
            raise StreamNotFoundError(
                f"stream {self.stream!r} has no state under key prefix "
                f"{self.store.stream_prefix!r}: check the stream name and --key-prefix (list "
                "streams with `airflow-keyset status`). If the name is right, Redis lost the "
                "stream's state (flushed, evicted or restarted "
                "without persistence)."
            )

    def stream_status(
        self, round_id: str | None = None, *, with_rounds: bool = True
    ) -> StreamStatus:
        """The stream's watermark, retention floor, round counter and its open rounds (or only
        ``round_id``, open or closed; none without ``with_rounds``). Raises
        ``StreamNotFoundError`` for a stream with no state."""
        self.require_stream()
        open_ids = self.open_rounds()
        rounds: list[RoundStatus] = []
        floor_from: list[RoundStatus] | None = None
        if round_id is not None:
            rounds = [self.round_status(round_id)]
        elif with_rounds:
            rounds = floor_from = [self.round_status(rid) for rid in open_ids]
        wm = self.store.watermark()
        arity = (len(decode_key(wm)) if wm else 0) or 1
        return StreamStatus(
            stream=self.stream,
            key_prefix=self.store.stream_prefix,
            watermark_encoded=wm,
            arity=arity,
            retention_floor=self.retention_floor(floor_from),
            rounds_planned=self.store.round_counter() or 0,
            open_rounds=tuple(open_ids),
            rounds=tuple(rounds),
            control=self.control_state(),
        )

    # ---- pause, resume, throttle (the control hash: core/pace/stream_control.py) -----------------
    def control_state(self) -> ControlState:
        """The stream's pause and throughput budget."""
        return StreamSwitch(self.store).state()

    def pause(self, reason: str = "", by: str = "") -> ControlState:
        """Pause every task of the stream (see ``StreamSwitch.pause``)."""
        return StreamSwitch(self.store).pause(reason, by)

    def resume(self) -> bool:
        """Lift a pause; True if the stream was paused."""
        return StreamSwitch(self.store).resume()

    def throttle(self, max_rows_per_second: float | None) -> ControlState:
        """Set (None: lift) the stream's shared rows-per-second budget."""
        return StreamSwitch(self.store).throttle(max_rows_per_second)

    def _now_ms(self) -> int:
        try:
            return self.store.server_time_ms()
        except Exception:  # a reading for display: the local clock is good enough then
            return int(time.time() * 1000)

    def check_round(self, round_id: str) -> RoundCheck:
        """A read-only look at the round (the barrier polls it). A round Redis lost, wholly or in
        part, is restored from the checkpoint mirror first, exactly as ``close_round`` does;
        without a mirror that loss raises ``RoundStateLostError``."""
        closed_by_mirror(self, round_id)  # a close Redis lost is not done twice
        return self.restoring(round_id, lambda: self._check_round(round_id))

    def _check_round(self, round_id: str) -> RoundCheck:
        if self.store.round_state(round_id) == RoundState.CLOSED:
            return RoundCheck(round_id, RoundState.CLOSED, True, [])
        rnd = self.round_status(round_id)
        lagging = [
            r
            for r in rnd.ranges
            if r.state != RangeState.COMPLETE or r.cursor_encoded != r.hi_encoded
        ]
        return RoundCheck(round_id, rnd.state, not lagging, lagging)

    def close_round(self, round_id: str) -> RoundTotals:
        """Close the round if every range is complete and they cover ``(start, end]`` with no gap;
        move the watermark forward. Idempotent. Raises ``RoundIncompleteError`` (with the lagging
        ranges) otherwise, ``RetentionError`` for an unrecoverable round and
        ``RoundStateLostError`` if Redis lost the round (and no mirror could restore it)."""
        closed_by_mirror(self, round_id)  # a close Redis lost is not done twice
        res = self.restoring(round_id, lambda: self.store.close_round(round_id))
        info = self.store.round_info(round_id)
        arity = self._arity(info)
        start, end = decode_user_key(info["start"], arity), decode_user_key(info["end"], arity)
        if isinstance(res, Closed):
            if self.mirror is not None:
                self._mirror_round(round_id)
                if res.watermark:
                    self.mirror.save_watermark(self.stream, res.watermark)
            return RoundTotals(
                round_id,
                start,
                end,
                res.done,
                res.skipped,
                res.dead,
                decode_user_key(res.watermark, arity) if res.watermark else None,
            )
        if isinstance(res, Unrecoverable):
            raise RetentionError(
                f"round {round_id} is unrecoverable and will never close: {res.reason}"
            )
        if isinstance(res, Gap):
            raise RoundIncompleteError(
                f"round {round_id}: ranges do not cover (start, end] at range {res.range_id}"
            )
        lagging = [r for r in self.range_status(round_id) if r.range_id in set(res.range_ids)]
        raise RoundIncompleteError(
            f"round {round_id}: {len(lagging)} range(s) not complete: "
            + "; ".join(r.describe() for r in lagging[:10]),
            lagging=lagging,
        )

    def dead_letters(self, round_id: str, range_id: int, limit: int = 100) -> list[dict[str, Any]]:
        """Newest first: ``{key, error, attempts, at_ms}`` with ``key`` decoded."""
        arity = self._arity(self.store.round_info(round_id))
        out = self.store.dead_letters(round_id, range_id, limit)
        for d in out:
            d["key"] = decode_user_key(d["key"], arity)
        return out

    def reset_round(self, round_id: str, *, confirm: bool = False) -> int:
        """Delete a round's control state (ranges, cursors, retries, dead letters). The watermark is
        never moved: an open round's rows are traversed again by the next plan. Returns the number
        of keys removed."""
        if not confirm:
            raise ConfigurationError(
                "reset_round deletes the round's cursors and dead letters; pass confirm=True"
            )
        return self.store.delete_round(round_id)


def list_streams(client: Any, prefix: str) -> list[StreamStatus]:
    """Every stream under ``prefix`` (found with SCAN), without its rounds."""
    out = []
    for name in stream_names(client, prefix):
        try:
            ctl = StreamControl(CursorStore(client, name, prefix=prefix))
        except ConfigurationError:
            continue  # not one of ours
        out.append(ctl.stream_status(with_rounds=False))
    return out
