"""Reading and closing rounds of a stream: everything that needs Redis but not the source.

Used by the barrier (sensor and trigger), the CLI and the UI, none of which need a database
connection to answer "how far is this round?" or to close it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from .errors import ConfigurationError, RetentionError, RoundIncompleteError, RoundStateLostError
from .keys import MIN_KEY, decode_key, display_key, from_tuple, to_json
from .mirror import CheckpointMirror
from .store import CursorStore

log = logging.getLogger("airflow_keyset_provider")


def _decode(encoded: str, arity: int) -> Any:
    return None if encoded == MIN_KEY else from_tuple(decode_key(encoded), arity)



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
        return {"round_id": self.round_id, "start_key": to_json(self.start_key),
                "end_key": to_json(self.end_key), "done": self.done, "skipped": self.skipped,
                "dead": self.dead, "watermark": to_json(self.watermark)}



@dataclass(frozen=True)
class RoundCheck:
    """A read-only look at a round: ``complete`` is true when every range is complete (the close
    itself re-checks coverage atomically)."""

    round_id: str
    state: str
    complete: bool
    lagging: list[dict[str, Any]]


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
        info, ranges = doc
        if self.store.restore_round(info, ranges):
            arity = self._arity(info)
            for r in ranges:
                log.warning(
                    "round %s range %s restored from the checkpoint mirror after Redis lost it: cursor %s, "
                    "done %s, skipped %s, dead %s, %d retry, state %s; keys committed after that cursor are "
                    "delivered again (at-least-once)", round_id, r["range_id"], display_key(r["cursor"], arity),
                    r["done"], r["skipped"], r["dead"], len(r.get("retry") or {}), r["state"])
        return True

    def recover_stream(self) -> None:
        """If Redis lost the stream (no round counter) but the mirror knows it, put back the
        watermark and every round that was still open."""
        if self.mirror is None or self.store.client.exists(f"{self.store.base}:seq"):
            return
        # round ids are never reused: the counter resumes after the highest mirrored round
        self.store.client.set(f"{self.store.base}:seq", self.mirror.max_round_number(self.stream), nx=True)
        wm = self.mirror.load_watermark(self.stream)
        if wm is not None and self.store.restore_watermark(wm):
            log.warning("stream %s: watermark restored from the checkpoint mirror", self.stream)
        for info in self.mirror.rounds(self.stream):
            if info.get("state") != "closed":
                self.restore(info["id"])

    def _mirror_round(self, round_id: str) -> None:
        if self.mirror is not None:
            info = self.store.round_info(round_id)
            ranges = [self.store.snapshot_range(round_id, i) for i in range(int(info["n_ranges"]))]
            self.mirror.save_round(self.stream, round_id, info, ranges)

    def _arity(self, info: dict[str, str]) -> int:
        return int(info.get("arity", "1"))

    def round(self, round_id: str) -> Round:
        info = self.store.round_info(round_id)
        arity = self._arity(info)
        ranges = self.store.ranges(round_id, int(info["n_ranges"]))
        specs = [
            RangeSpec(
                range_id=int(r["range_id"]), lo=_decode(r["lo"], arity), hi=_decode(r["hi"], arity),
                lo_encoded=r["lo"], hi_encoded=r["hi"],
                label=f"range {r['range_id']} ({display_key(r['lo'], arity)}, {display_key(r['hi'], arity)}]",
            )
            for r in ranges
        ]
        return Round(round_id, self.stream, _decode(info["start"], arity), _decode(info["end"], arity), specs,
                     info["start"], info["end"], info["state"])

    def watermark(self) -> Any:
        """The end of the stream's contiguous completed prefix (None before the first round)."""
        wm = self.store.watermark()
        if wm is None:
            return None
        return from_tuple(decode_key(wm), len(decode_key(wm)))

    def retention_floor(self) -> Any:
        """The highest key at or below which the source may delete rows without harming any round
        (None: keep everything). It is the lowest of: each incomplete range's cursor (its ``lo``
        while it has items waiting for a retry, which are re-read by key), and the watermark unless
        a chained round is open (the next chained round starts there)."""
        candidates: list[str] = []
        chained_open = self.store.lookup(None, chained=True)
        for rid in self.store.open_rounds():
            for r in self.store.ranges(rid):
                if r["state"] != "complete":
                    candidates.append(r["lo"] if int(r["retries"]) else r["cursor"])
        if chained_open is None:
            candidates.append(self.store.watermark() or MIN_KEY)
        floor = min(candidates) if candidates else MIN_KEY
        if floor == MIN_KEY:
            return None
        values = decode_key(floor)
        return from_tuple(values, len(values))

    def open_rounds(self) -> list[str]:
        return self.store.open_rounds()

    def range_status(self, round_id: str) -> list[dict[str, Any]]:
        """Per range: ids, decoded ``lo``/``hi``/``cursor`` (and ``*_label`` renderings), ``state``,
        ``owner``, ``lease_left_s``, ``heartbeat_age_s``, counters, ``retries``, ``takeovers``."""
        info = self.store.round_info(round_id)
        arity = self._arity(info)
        now_ms = _redis_now_ms(self.store)
        out = []
        for r in self.store.ranges(round_id, int(info["n_ranges"])):
            hb = int(r.get("heartbeat_ms", "0") or 0)
            lease = int(r.get("lease_until", "0") or 0)
            out.append({
                "range_id": int(r["range_id"]),
                "lo": _decode(r["lo"], arity), "hi": _decode(r["hi"], arity), "cursor": _decode(r["cursor"], arity),
                "lo_label": display_key(r["lo"], arity), "hi_label": display_key(r["hi"], arity),
                "cursor_label": display_key(r["cursor"], arity),
                "lo_encoded": r["lo"], "hi_encoded": r["hi"], "cursor_encoded": r["cursor"],
                "state": r["state"], "owner": r.get("owner", ""),
                "lease_left_s": max(lease - now_ms, 0) / 1000 if r.get("owner") else 0.0,
                "heartbeat_age_s": (now_ms - hb) / 1000 if hb else None,
                "done": int(r["done"]), "skipped": int(r["skipped"]), "dead": int(r["dead"]),
                "retries": int(r["retries"]), "takeovers": int(r.get("takeovers", "0")),
                "chunks": int(r.get("chunks", "0")),
            })
        return out

    def check_round(self, round_id: str) -> RoundCheck:
        info = self.store.round_info(round_id)
        if info["state"] == "closed":
            return RoundCheck(round_id, "closed", True, [])
        lagging = [r for r in self.range_status(round_id)
                   if r["state"] != "complete" or r["cursor_encoded"] != r["hi_encoded"]]
        return RoundCheck(round_id, info["state"], not lagging, lagging)

    def close_round(self, round_id: str) -> RoundTotals:
        """Close the round if every range is complete and they cover ``(start, end]`` with no gap;
        move the watermark forward. Idempotent. Raises ``RoundIncompleteError`` (with the lagging
        ranges) otherwise, and ``RoundStateLostError`` if Redis lost the round."""
        try:
            status, values = self.store.close_round(round_id)
        except RoundStateLostError:
            if not self.restore(round_id):
                raise
            status, values = self.store.close_round(round_id)
        info = self.store.round_info(round_id)
        arity = self._arity(info)
        start, end = _decode(info["start"], arity), _decode(info["end"], arity)
        if status == "closed":
            done, skipped, dead, wm = values
            if self.mirror is not None:
                self._mirror_round(round_id)
                if wm:
                    self.mirror.save_watermark(self.stream, wm)
            return RoundTotals(round_id, start, end, int(done), int(skipped), int(dead),
                               _decode(wm, arity) if wm else None)
        if status == "unrecoverable":
            raise RetentionError(f"round {round_id} is unrecoverable and will never close: {values[0]}")
        if status == "gap":
            raise RoundIncompleteError(f"round {round_id}: ranges do not cover (start, end] at range {values[0]}")
        lagging = [r for r in self.range_status(round_id) if str(r["range_id"]) in set(values)]
        raise RoundIncompleteError(
            f"round {round_id}: {len(lagging)} range(s) not complete: "
            + "; ".join(describe_range(r) for r in lagging[:10]),
            lagging=lagging,
        )

    def dead_letters(self, round_id: str, range_id: int, limit: int = 100) -> list[dict[str, Any]]:
        """Newest first: ``{key, error, attempts, at_ms}`` with ``key`` decoded."""
        arity = self._arity(self.store.round_info(round_id))
        out = self.store.dead_letters(round_id, range_id, limit)
        for d in out:
            d["key"] = _decode(d["key"], arity)
        return out

    def reset_round(self, round_id: str, *, confirm: bool = False) -> int:
        """Delete a round's control state (ranges, cursors, retries, dead letters). The watermark is
        never moved: an open round's rows are traversed again by the next plan. Returns the number
        of keys removed."""
        if not confirm:
            raise ConfigurationError("reset_round deletes the round's cursors and dead letters; pass confirm=True")
        return self.store.delete_round(round_id)


def describe_range(r: dict[str, Any]) -> str:
    """One line for logs and errors about a lagging range."""
    hb = r.get("heartbeat_age_s")
    owner = r.get("owner") or "no owner"
    beat = f"last heartbeat {hb:.0f} s ago" if hb is not None else "never claimed"
    return (f"range {r['range_id']} at {r['cursor_label']} of {r['hi_label']} ({r['state']}, {owner}, "
            f"{beat}, retry {r['retries']})")


def _redis_now_ms(store: CursorStore) -> int:
    try:
        secs, micros = store.client.time()
        return int(secs) * 1000 + int(micros) // 1000
    except Exception:
        return int(time.time() * 1000)
