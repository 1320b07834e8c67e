"""Redis went back in time: what a failover to a lagging replica leaves, and what the checkpoint
mirror puts right.

A replica promoted after its primary died misses the writes the primary acknowledged last: the
Redis state the clients see next is intact (nothing reads as lost) but *older* than what was
committed, and older than the mirror, which recorded those commits. The mirror then knows what
Redis forgot; each kind of regression is either restored from it or is only a replay:

- **a round the mirror has but Redis never heard of** (numbered above Redis's round counter): it
  was planned (and maybe closed) on the lost primary. Restored from the mirror, open or closed, so
  its idempotency key finds it again; the counter moves up past it, so no round id is handed out
  twice (a second round ``rN`` would overwrite the first one's mirror rows).
- **a round the mirror has closed but Redis has open** (its close was lost): restored as the
  mirror closed it (its final ranges, totals and ``closed_ms``), so it never closes a second time;
  its tasks find it closed.
- **a watermark behind the mirror's**: moved forward to the mirror's (never backwards), so the
  next chained round starts where the closed rounds end.
- **an open round the mirror has with more ranges than Redis** (a split Redis lost): Redis's
  ranges are a partition of the round, the mirror's extra ranges are not part of it any more; the
  mirror is rewritten from Redis and its extra rows dropped, so a later restore is a partition.
- **an open round the mirror never recorded** (the plan's mirror write failed, so the plan
  raised; this is its retry): recorded now, before the plan returns it.
- **a range whose cursor is behind the mirror's checkpoint, or that reverted from complete to
  incomplete**: the keys in between are delivered again (at-least-once) and counted again, so the
  totals are exact at the close. Not restored: intact state in Redis is never overwritten while
  an owner may hold it.

``reconcile`` runs where the engine looks at a stream as a whole (``StreamControl.recover_stream``:
every plan); ``closed_by_mirror`` before a close and a barrier check.
"""

from __future__ import annotations

import itertools
import logging
from typing import TYPE_CHECKING, Any, Protocol

from ..keys import display_key
from ..states import RangeState, RoundState

if TYPE_CHECKING:
    from ..store.cursor_store import CursorStore
    from .mirror import CheckpointMirror


class StreamControl(Protocol):
    """What the reconciliation uses of the round operations (``control.StreamControl``)."""

    store: CursorStore
    mirror: CheckpointMirror | None
    stream: str

    def restore(self, round_id: str) -> bool: ...

    def _mirror_round(self, round_id: str) -> int: ...


log = logging.getLogger("airflow_keyset_provider")


def _number(round_id: str) -> int:
    return int(round_id[1:]) if round_id[1:].isdigit() else 0


def restore_closed(ctl: StreamControl, round_id: str) -> bool:
    """Put back a round as the mirror closed it (its Redis copy, open or missing, goes first).
    False when the mirror does not hold it closed."""
    doc = ctl.mirror.load_round(ctl.stream, round_id) if ctl.mirror else None
    if doc is None or doc[0].get("state") != RoundState.CLOSED:
        return False
    info, ranges = doc
    if ctl.store.round_state(round_id) is not None:
        ctl.store.delete_round(round_id)
    ctl.store.restore_round(info, ranges)
    log.warning(
        "round %s of stream %s: Redis has it open (or not at all) but the checkpoint mirror "
        "recorded its close (Redis lost writes: a failover to a lagging replica?); restored as "
        "closed from the mirror, so it never closes twice",
        round_id,
        ctl.stream,
    )
    return True


def closed_by_mirror(ctl: StreamControl, round_id: str) -> bool:
    """Before a close or a barrier check: if Redis has the round open but the mirror has it
    closed, restore it closed (and the watermark forward). True when it did."""
    if ctl.mirror is None or ctl.store.round_state(round_id) == RoundState.CLOSED:
        return False
    try:
        if ctl.mirror.round_state(ctl.stream, round_id) != RoundState.CLOSED:
            return False
    except Exception as exc:  # the mirror is a safety net: its outage must not stop a barrier
        log.warning("round %s: could not compare it with the checkpoint mirror: %s", round_id, exc)
        return False
    if not restore_closed(ctl, round_id):
        return False
    watermark_forward(ctl)
    return True


def watermark_forward(ctl: StreamControl) -> None:
    wm = ctl.mirror.load_watermark(ctl.stream) if ctl.mirror else None
    if wm is not None and ctl.store.forward_watermark(wm):
        log.warning(
            "stream %s: the watermark in Redis was behind the checkpoint mirror's (Redis lost "
            "a close); moved forward to the mirror's",
            ctl.stream,
        )


#: After Redis lost a stream's round counter, at most this many of the newest closed rounds are
#: put back from the mirror (their idempotency keys then find them); every open round is.
RESTORE_CLOSED_MAX = 64


def reconcile(ctl: StreamControl) -> None:
    """Every regression the module docstring lists, for the whole stream (a plan calls it). A
    stream Redis lost whole (no round counter) is the same case with a counter of 0."""
    mirror = ctl.mirror
    if mirror is None:
        return
    counter = ctl.store.round_counter() or 0
    rounds = mirror.rounds(ctl.stream)
    top = max((_number(i["id"]) for i in rounds), default=0)
    if top > counter:
        ctl.store.forward_round_counter(top)
        log.warning(
            "stream %s: Redis's round counter %d is behind the checkpoint mirror's rounds (up "
            "to %d): Redis lost writes (a failover to a lagging replica?); the counter moves "
            "up, rounds it never saw are restored from the mirror",
            ctl.stream,
            counter,
            top,
        )
    open_ids = set(ctl.store.open_rounds())
    for rid in sorted(open_ids - {i["id"] for i in rounds}):
        _mirror_unmirrored(ctl, rid)
    for info in rounds:
        rid, closed = info["id"], info.get("state") == RoundState.CLOSED
        lost = _number(rid) > counter and ctl.store.round_state(rid) is None  # never heard of
        if lost and not closed:
            ctl.restore(rid)
        elif lost and _number(rid) > top - RESTORE_CLOSED_MAX:
            restore_closed(ctl, rid)
        elif rid in open_ids:
            if closed:
                restore_closed(ctl, rid)
            else:
                _drop_lost_splits(ctl, rid, int(info.get("n_ranges") or 0))
    watermark_forward(ctl)


def _mirror_unmirrored(ctl: StreamControl, round_id: str) -> None:
    """An open round the mirror never recorded (its plan's mirror write failed; the plan raised
    and this is its retry): record it now, or a Redis loss would leave it unrecoverable."""
    ctl._mirror_round(round_id)
    log.warning(
        "round %s of stream %s: the checkpoint mirror had no record of it (its plan's mirror "
        "write failed); recorded now",
        round_id,
        ctl.stream,
    )


def _drop_lost_splits(ctl: StreamControl, round_id: str, mirrored_n: int) -> None:
    """An open round whose mirror has more ranges than Redis: Redis lost a split (its ranges
    are the round's partition); the mirror follows Redis."""
    n = int(ctl.store.round_info(round_id)["n_ranges"])
    if mirrored_n <= n or ctl.mirror is None:
        return
    # from the ranges the round has as recorded now (a split since the read above is kept); a
    # split's record that lands between the two is dropped: the restore covers its keys again
    # (``cover_lost_ranges``)
    ctl.mirror.drop_ranges(ctl.stream, round_id, ctl._mirror_round(round_id))
    log.warning(
        "round %s of stream %s: the checkpoint mirror holds %d ranges, Redis %d (Redis lost a "
        "split: a failover to a lagging replica?); the mirror now follows Redis",
        round_id,
        ctl.stream,
        mirrored_n,
        n,
    )


def end_overlaps(
    round_id: str, info: dict[str, Any], ranges: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Make the mirrored ranges of a round a partition again where two records overlap. Two
    ways there: a split's record is missing (the mirror holds the parent as it was before the
    split, its older, higher ``hi``, beside the range the split created, recorded by its own
    owner); or a range that coalesced its neighbours at claim time (its ``hi`` moved up over
    them, they became empty) is recorded beside one of those neighbours as another Redis
    timeline ran it (a failover to a replica that never saw the coalescing claim, then the
    neighbour's own checkpoint). Each record is true of its own timeline; the repair keeps every
    count exact:

    - the lower range ``R`` has committed nothing past the other's ``lo`` (``R.cursor <= lo``)
      and is not complete: ``R`` ends there, its counts untouched (they count keys up to its
      cursor). That is the split as it was made (a split's new range starts above the parent's
      cursor); after a coalescing, the keys above the other range that ``R`` covered are left to
      ``cover_lost_ranges`` (a pending range again: at-least-once), and ``R``'s coalescing hint
      (``skip:<R>`` in ``info``) goes, so pulling tasks hand out the ranges it had absorbed;
    - else ``R`` committed keys of the other range (or completed): the other range is absorbed
      as the coalescing made it (empty and complete at ``R.hi``, ``merged_into`` ``R``, no
      counts, retries or dead letters: ``R``'s record counts those keys and holds their
      verdicts; what it had not reached yet it delivers).

    Repeated until no two non-empty ranges overlap. Changes ``ranges`` and ``info`` in place;
    returns the ranges it changed (to write back)."""
    changed: dict[int, dict[str, Any]] = {}
    while True:
        live = sorted(
            (r for r in ranges if r["lo"] != r["hi"]),
            key=lambda r: (r["lo"], r["hi"], int(r["range_id"])),
        )
        pair = next(((a, b) for a, b in itertools.pairwise(live) if b["lo"] < a["hi"]), None)
        if pair is None:
            return list(changed.values())
        low, other = pair
        if low["cursor"] <= other["lo"] and low["state"] != RangeState.COMPLETE:
            how = f"ends where range {other['range_id']} starts"
            low["hi"] = other["lo"]
            info.pop(f"skip:{low['range_id']}", None)
            changed[int(low["range_id"])] = low
        else:
            how = f"absorbs range {other['range_id']} again"
            other.update(
                lo=low["hi"],
                hi=low["hi"],
                cursor=low["hi"],
                state=RangeState.COMPLETE,
                merged_into=str(low["range_id"]),
                retry={},
                dead_letters=[],
                **{f: "0" for f in ("done", "skipped", "dead", "retries", "chunks", "takeovers")},
            )
            changed[int(other["range_id"])] = other
        log.warning(
            "round %s: the checkpoint mirror holds ranges %s and %s over the same keys (a split "
            "whose record it missed, or a coalescing one Redis timeline made and another never "
            "saw); range %s %s",
            round_id,
            low["range_id"],
            other["range_id"],
            low["range_id"],
            how,
        )


def cover_lost_ranges(
    round_id: str, info: dict[str, Any], ranges: list[dict[str, Any]], n: int
) -> tuple[int, list[dict[str, Any]]]:
    """Make the mirrored ranges of a round (``ranges``, ids ``0 .. n - 1`` counted, after
    ``end_overlaps``) a partition of ``(start, end]`` again where the mirror lost a range
    that a split made: a range id it counts but holds no record of (its record was dropped, or
    never written, while the round's info counts it), and keys no record covers (a gap). Each
    gap becomes a range again, pending at its ``lo`` with nothing committed (its keys are
    delivered again: at-least-once; ``exactly_once``'s ledger skips what was written), under a
    lost id first, then under new ids; a lost id left over (its keys are covered by the others)
    becomes an empty, complete range at the round's end. Appends the new records to ``ranges``;
    returns the round's number of ranges and the new records (to write back to the mirror)."""
    from .mirror import split_range_doc  # the range as a split makes it

    held = {int(r["range_id"]) for r in ranges}
    lost = [i for i in range(n) if i not in held]
    expect, end = str(info.get("start") or ""), str(info["end"])
    gaps: list[tuple[str, str]] = []
    for r in sorted(ranges, key=lambda r: (r["lo"], r["hi"], int(r["range_id"]))):
        if r["lo"] > expect:
            gaps.append((expect, r["lo"]))
        expect = max(expect, r["hi"])
    if expect < end:
        gaps.append((expect, end))
    new: list[dict[str, Any]] = []
    arity = int(info.get("arity") or 1)
    ids = iter(lost + list(range(n, n + len(gaps))))
    for lo, hi in gaps:
        new.append(split_range_doc({"range_id": ""}, next(ids), lo, hi))
    for i in ids:
        if i >= n:
            break
        empty = split_range_doc({"range_id": ""}, i, end, end)
        new.append({**empty, "state": RangeState.COMPLETE})
    for r in new:
        log.warning(
            "round %s range %s: the checkpoint mirror holds no record of the keys (%s, %s] (a "
            "split's range whose record was lost); rebuilt pending at its lo, those keys are "
            "delivered again (at-least-once)",
            round_id,
            r["range_id"],
            display_key(r["lo"], arity),
            display_key(r["hi"], arity),
        )
    ranges.extend(new)
    return max([n, *(int(r["range_id"]) + 1 for r in new)]), new


__all__ = [
    "closed_by_mirror",
    "cover_lost_ranges",
    "end_overlaps",
    "reconcile",
    "restore_closed",
]
