"""The cursor store's part for tasks that pull ranges and split stragglers (``CursorStore``
inherits it; the key layout and the other writes are in ``cursor_store.py``).

A round may have many more ranges than tasks: a task claims ``next_unclaimed`` ranges until none
is left, then asks the live owner of the range with the most work left to split it. The split is
the *owner's* act, at one of its chunk boundaries (``split``), so no key it may be processing
changes hands: it passes a key above everything it has read, the script refuses one that is not
strictly between the range's committed cursor and its ``hi``, and in one step the range becomes
``(lo, at]`` and a new pending range ``(at, hi]`` is appended (``n_ranges`` grows by one). The
ranges therefore partition ``(start, end]`` whatever the splits, and ``close_round`` checks it by
walking them in key order. Every claim stays fenced per range (owner token, lease, epoch).

The inverse, coalescing, is the claim's (``CursorStore.claim(..., coalesce=m)``, the ``CLAIM``
script): it absorbs fresh ranges that follow the claimed one, each left empty at the new end, so
the partition holds again; ``next_unclaimed`` jumps over what a claim absorbed (``skip:<id>``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import RoundStateLostError
from .reads import StoreReads, _s, call_id
from .scripts import NEXT_UNCLAIMED, OPEN_BRIEFS, REQUEST_SPLIT, SPLIT, SPLIT_ANSWER

if TYPE_CHECKING:
    from redis.commands.core import Script

_BRIEF_FIELDS = (
    "lo",
    "hi",
    "cursor",
    "state",
    "owner",
    "lineage",
    "lease_until",
    "done",
    "chunks",
    "claimed_ms",
    "split_req",
)
BRIEF_BATCH = 512  # ranges per pipelined round trip: each HMGET is small, no call blocks Redis


@dataclass(frozen=True)
class RangeBrief:
    """What a pulling task needs to know of one range (a pipelined, non-atomic read: each range
    is read whole, ranges at slightly different times). ``lease_ms_left`` is measured on the
    Redis server's clock; 0 when nobody holds the range."""

    range_id: int
    lo: str
    hi: str
    cursor: str
    state: str
    owner: str
    lineage: str
    lease_ms_left: int
    done: int
    chunks: int
    claimed_ms: int
    split_req: str

    @property
    def live_owner(self) -> bool:
        return bool(self.owner) and self.lease_ms_left > 0


class RangePull(StoreReads):
    """``next_unclaimed``, ``range_briefs``, ``open_briefs``, ``request_split``, ``split`` and ``split_answer``;
    ``CursorStore`` inherits them."""

    def __init__(self, client: Any, stream: str, prefix: str = "ks") -> None:
        super().__init__(client, stream, prefix)
        reg = self.script
        self._next: Script = reg(NEXT_UNCLAIMED)
        self._open_briefs: Script = reg(OPEN_BRIEFS)
        self._ask_split: Script = reg(REQUEST_SPLIT)
        self._split: Script = reg(SPLIT)
        self._split_answer: Script = reg(SPLIT_ANSWER)

    def next_unclaimed(self, round_id: str) -> int | None:
        """The next range id this round's hint counter never handed out, or None when it passed
        ``n_ranges`` (or the round is no longer open). The caller claims the id as usual; the
        counter is only a hint (a complete or held range is simply skipped; a claim that
        coalesces ranges moves the counter past them)."""
        nxt = self.next_unclaimed_of(round_id)
        return None if nxt is None else nxt[0]

    def next_unclaimed_of(self, round_id: str) -> tuple[int, int] | None:
        """``next_unclaimed`` with the round's ``n_ranges`` read in the same step."""
        res = self._call(self._next, [self.round_key(round_id)], [call_id()])
        status = _s(res[0])
        if status == "lost":
            raise self._missing_round(round_id)
        if status != "ok":
            return None
        n = int(res[2])  # read in the same step as the id
        i = int(res[1])
        return (i, n) if i < n else None

    def range_briefs(self, round_id: str) -> list[RangeBrief]:
        """Every range of the round, read with pipelined HMGETs in batches of ``BRIEF_BATCH``
        (O(ranges), no single call long). Raises ``RoundStateLostError`` for a missing range."""
        n = int(self.round_info(round_id)["n_ranges"])
        now = self.server_time_ms()
        out: list[RangeBrief] = []
        for first in range(0, n, BRIEF_BATCH):
            ids = range(first, min(n, first + BRIEF_BATCH))
            pipe = self.client.pipeline(transaction=False)
            for i in ids:
                pipe.hmget(self.range_key(round_id, i), _BRIEF_FIELDS)
            for i, values in zip(ids, pipe.execute(), strict=True):
                out.append(
                    self._brief(round_id, i, [_s(v) if v is not None else "" for v in values], now)
                )
        return out

    def open_briefs(
        self, round_id: str, known_complete: set[int] | None = None, lineage: str = ""
    ) -> list[RangeBrief]:
        """``range_briefs`` of the ranges that are not complete, filtered in Redis (one script per
        ``BRIEF_BATCH`` ranges, each O(batch)): what a pulling task polls, so a poll at the end of
        a round of thousands of ranges returns the few left, not all of them. ``known_complete``
        (the caller's, updated here): ids found complete before, not read again, and those found
        complete now (a complete range reopens only when an operator replays its dead letters,
        and that replay traverses it). ``lineage``: only the ranges of that lineage (filtered in
        Redis too). Raises ``RoundStateLostError`` for a missing range."""
        n = self._n_ranges(round_id, known_complete)
        skip = known_complete if known_complete is not None else set()
        ids = [i for i in range(n) if i not in skip]
        width = len(_BRIEF_FIELDS) + 1
        out: list[RangeBrief] = []
        for first in range(0, len(ids), BRIEF_BATCH):
            batch = ids[first : first + BRIEF_BATCH]
            keys = [self.range_key(round_id, i) for i in batch]
            res = self._call(
                self._open_briefs, keys, [lineage, len(_BRIEF_FIELDS), *_BRIEF_FIELDS, *batch]
            )
            if _s(res[0]) == "lost":
                raise RoundStateLostError(
                    f"{self._where(round_id, int(res[1]))} has no state in Redis"
                )
            now = int(res[1])
            for j in range(2, len(res), width):
                values = [_s(v) for v in res[j + 1 : j + width]]
                out.append(self._brief(round_id, int(res[j]), values, now))
        if known_complete is not None and not lineage:
            known_complete.update(set(ids) - {b.range_id for b in out})
        return out

    def _n_ranges(self, round_id: str, known_complete: set[int] | None = None) -> int:
        """The round's ``n_ranges``; with ``known_complete``, one read of the round hash that
        also adds the ids coalesced into other ranges (``skip:<id>`` = the first id after the
        run): empty and complete for good (a replay of dead letters has none to reopen)."""
        if known_complete is None:
            n = self.client.hget(self.round_key(round_id), "n_ranges")
            if n is None:
                raise self._missing_round(round_id)
            return int(n)
        info = self.round_info(round_id)
        for name, after in info.items():
            if name.startswith("skip:"):
                known_complete.update(range(int(name[5:]) + 1, int(after)))
        return int(info["n_ranges"])

    def held_by(self, round_id: str, lineage: str) -> int | None:
        """The range a pulling task of ``lineage`` claimed last (``claim(..., pull=True)``)."""
        v = self.client.hget(self.round_key(round_id), f"held:{lineage}")
        return None if v is None else int(v)

    def _brief(self, round_id: str, i: int, v: list[str], now: int) -> RangeBrief:
        if not v[0] and not v[1]:
            raise RoundStateLostError(f"{self._where(round_id, i)} has no state in Redis")
        lease_until = int(v[6] or 0)
        return RangeBrief(
            range_id=i,
            lo=v[0],
            hi=v[1],
            cursor=v[2] or (v[1] if v[3] == "complete" else v[0]),  # a complete range: hi
            state=v[3] or "pending",
            owner=v[4],
            lineage=v[5],
            lease_ms_left=max(lease_until - now, 0) if v[4] else 0,
            done=int(v[7] or 0),
            chunks=int(v[8] or 0),
            claimed_ms=int(v[9] or 0),
            split_req=v[10],
        )

    def request_split(
        self, round_id: str, range_id: int, requester: str, stale_ms: int = 60_000
    ) -> str:
        """Ask the live owner of a running range to split it at its next chunk boundary:
        ``'asked'`` | ``'busy'`` (another requester's request younger than ``stale_ms`` is
        pending) | ``'not_running'`` (claim it instead) | ``'closed'`` | ``'lost'``."""
        keys = [self.round_key(round_id), self.range_key(round_id, range_id)]
        return _s(self._call(self._ask_split, keys, [requester, stale_ms, call_id()]))

    def split_answer(self, round_id: str, range_id: int, requester: str) -> str | None:
        """None while the request is pending; else the new range id (a string) or ``'no'``."""
        res = self._call(self._split_answer, [self.range_key(round_id, range_id)], [requester])
        status = _s(res[0])
        if status == "pending":
            return None
        return _s(res[1]) if status == "ok" else "no"

    def split(
        self, round_id: str, range_id: int, token: str, at: str | None, mirror: bool = False
    ) -> int | None:
        """Run by the range's owner between chunks: split at ``at`` (a real key above every key
        this owner has read, below ``hi``) and return the new range's id; ``at=None`` declines
        the pending request. Returns None when refused (not the owner, lease expired, round not
        open, ``at`` not strictly inside ``(cursor, hi)``) or declined; nothing is written then.
        ``mirror``: the caller keeps a checkpoint mirror; the split marks the range
        ``unmirrored_split:<new id>`` until ``mirrored_split``.
        Raises ``RoundStateLostError`` when the round or the range lost state."""
        call = call_id()  # one per split ('moved' wrote nothing: the next try keeps it)
        for _ in range(20):
            n = int(self.round_info(round_id)["n_ranges"])
            keys = [
                self.round_key(round_id),
                *self._range_keys(round_id, range_id),
                *self._range_keys(round_id, n),
                self.events_channel,
            ]
            args = [token, at or "", n, range_id, call, "1" if mirror else ""]
            res = self._call(self._split, keys, args)
            status = _s(res[0])
            if status == "ok":
                return int(_s(res[1]))
            if status == "lost":
                raise RoundStateLostError(f"{self._where(round_id, range_id)} lost state in Redis")
            if status == "taken":
                raise RoundStateLostError(
                    f"round {round_id} of stream {self.stream!r}: range {n} exists although the "
                    f"round counts {n} ranges (its hash was restored from an older mirror?); "
                    "nothing was split. Check the round with `airflow-keyset ranges`."
                )
            if status != "moved":
                return None
            # another owner split first and took id n: read n again and retry
        raise RoundStateLostError(
            f"round {round_id} of stream {self.stream!r}: 20 splits in a row took the next range "
            "id first; nothing was split"
        )

    def mirrored_split(self, round_id: str, range_id: int, new_ids: Sequence[int]) -> None:
        """The checkpoint mirror has recorded these splits of the range: clear their marks."""
        if new_ids:
            fields = [f"unmirrored_split:{i}" for i in new_ids]
            self.client.hdel(self.range_key(round_id, range_id), *fields)


__all__ = ["BRIEF_BATCH", "RangeBrief", "RangePull"]
