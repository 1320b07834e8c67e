"""Pull mode: one task works through the ranges of a round until nothing is left for it.

``KeysetTraversal.traverse_round`` runs ``PullLoop.run``. Its steps, each range run by
``run_range`` with the same fencing as a one-range task (owner token, lease, epoch):

1. **resume**: the range this task's ``owner_lineage`` claimed last (``held_by``; a retry, or the
   call after a ``"budget"`` yield, picks up what the task held; if it is complete, nothing);
2. **first range**: the range the plan gave this task (``first_range``; the plan spreads the
   tasks' first ranges evenly over the key order, ``first_positions``);
3. **next**: ``CursorStore.next_unclaimed`` until it says none is left (a hint: a range it hands
   out may be held or complete; the claim decides);
4. **rescue**: ranges that are not complete and have no live owner (released, or their owner's
   lease ran out: a dead worker's ranges wait one lease, not one Airflow retry);
5. **split** (``split=True``): ask the running range with the most work left to split
   (``request_split``), wait for its owner's answer (``split_answer``, polled every
   ``SPLIT_POLL_FIRST_SECONDS`` after the request, then twice as long each time up to
   ``SPLIT_POLL_SECONDS``, for at most ``SPLIT_ANSWER_LEASES`` leases), claim the new range.

Steps 3 to 5 repeat until nothing is left to claim, rescue or split; then the call returns
(``RoundPullResult.finished``). A range held by another live owner is skipped, never waited for.
A restore from the checkpoint mirror (by a range's run, or between ranges) may reopen any range
of the round at its last mirrored cursor, one this call finished included: after a restore the
call forgets what it learnt of the round (finished, seen complete, skipped, declined) and goes
through the steps again.
The owner splits at a chunk boundary above everything it read (``core/run/split.py``).

**Coalescing** (when the call knows how many ``tasks`` share the round): ranges are cheap because
a claim in steps 2 to 4 also absorbs the fresh ranges that follow it (``CursorStore.claim(...,
coalesce=m)``: never claimed, nothing committed, adjacent), up to ``m = ceil(left / tasks) - 1``
of them (``left``: the ranges not handed out yet; at most ``COALESCE_MAX``): the first claims
take a task's share of the round, later ones less and less (guided self-scheduling), and the tail
is balanced by splitting. The absorbed ranges stay in the round, empty (``lo = hi``) and
complete, so the ranges still partition ``(start, end]`` and ``CLOSE_ROUND`` proves it as ever; a
round of 4,096 ranges over 16 tasks then reads like one of 16 ranges (``benchmarks``:
``ranges_overhead``).

Which range to ask: the one with the most rows left by this estimate from its brief: the rows
committed so far per key-space fraction, times the fraction left, ``done * (1 - f) / f``, ``f``
being the cursor's key-space position in ``(lo, hi]`` (``core/rounds/progress.py``). A range without a
position (no commit yet, an open lower bound, a key with no numeric axis) ranks first; its owner
checks with the source before it splits. Rows rather than time: a brief carries cumulative
counters and only the current owner's claim time, so a rate would mix owners; a range that is slow
per row keeps most of its rows longest, so it ranks first anyway. Ranges with fewer than
``SPLIT_MIN_CHUNKS`` chunks left by the estimate are not asked, and a range that declined once is
not asked again by this call.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import random
import time
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..chunk import Processor
from ..errors import LeaseHeldError, RoundStateLostError
from ..options import TraverseOptions
from ..pace.stream_control import make_pacer
from ..rounds.progress import key_fraction
from ..rounds.status import RangeState
from .pull_result import RoundPullResult
from .range_run import BUDGET
from .split import SPLIT_MIN_CHUNKS
from .state import HeartbeatThread
from .traverse import RESTORES, check_range, run_restoring

if TYPE_CHECKING:
    from ..store.pull import RangeBrief
    from .context import RunContext

log = logging.getLogger("airflow_keyset_provider")

#: The most ranges one claim absorbs (bounds the claim script's time on Redis, ~2 us a range).
COALESCE_MAX = 1024
#: How often a requester reads the owner's answer to its split request.
SPLIT_POLL_SECONDS = 0.1
#: The first read of the answer: an owner between two short chunks answers within milliseconds,
#: and a requester that waited the full poll would end the round later than the owner alone.
SPLIT_POLL_FIRST_SECONDS = 0.005
#: How often a requester waiting for an answer checks that the owner still holds its lease.
SPLIT_OWNER_CHECK_SECONDS = 1.0
#: How long (in leases) a requester waits for an answer, or lets a range stay busy with another
#: requester's request, before it gives up on that range.
SPLIT_ANSWER_LEASES = 3
_AGAIN = -1  # ``_split``: nothing claimed, read the briefs again
_NEXT = "next unclaimed"


def remaining_rows(b: RangeBrief) -> float | None:
    """Rows left in a range by its brief (see the module docstring); None: unknown."""
    f = key_fraction(b.lo, b.hi, b.cursor, complete=b.state == RangeState.COMPLETE)
    if f is None or f <= 0:
        return None
    return b.done * (1 - f) / f


class PullLoop:
    """One ``traverse_round`` call (see the module docstring)."""

    def __init__(
        self,
        ctx: RunContext,
        round_id: str,
        processor: Processor,
        options: TraverseOptions,
        first_range: int | None,
        split: bool,
        tasks: int | None = None,
    ) -> None:
        self.ctx, self.store, self.round_id, self.processor = ctx, ctx.store, round_id, processor
        self.tasks = tasks  # how many tasks share the round (None: do not coalesce)
        self.n_ranges = 0  # read by ``_check_round``
        self.o = dataclasses.replace(options, claim_timeout=0)  # skip held ranges, never wait
        self.first_range, self.split = first_range, split
        self.lineage = options.owner_lineage
        self.requester = f"{self.lineage or 'worker'}#{uuid.uuid4().hex[:12]}"
        self.started = time.monotonic()
        budget = options.max_task_seconds
        self.deadline = self.started + budget if budget is not None else None
        self.result = RoundPullResult(round_id, self.lineage)
        self.finished: set[int] = set()  # complete, by this call's knowledge
        self.seen_complete: set[int] = set()  # complete when the briefs were read: not re-read
        self.skipped: set[int] = set()  # left incomplete without a reason: not taken again
        self.declined: set[int] = set()  # declined a split (or never answered): not asked again
        self.busy_since: dict[int, float] = {}
        # one pacer for the call's ranges (stream control read once at the start, then polled
        # every control_poll_seconds, as within a range), not one started and stopped per range
        self.pacer = make_pacer(ctx.store, ctx.source.engine, ctx.stop, self.o)
        self.beats = HeartbeatThread(self.o.lease_ms, f"pull-{round_id}")  # likewise the beats

    def run(self) -> RoundPullResult:
        self.pacer.start()
        self.beats.start()
        try:
            self._check_round()
            for _ in range(RESTORES):
                try:
                    return self._steps_to_the_end()
                except RoundStateLostError:
                    # lost between ranges (a range lost mid-way is restored by its run): put the
                    # round back from the mirror, if there is one, and go on
                    if not self.ctx.control.restore(self.round_id):
                        raise
                    self._forget()
            return self._steps_to_the_end()
        finally:
            self.pacer.stop()
            self.beats.stop()
            self.result.seconds = time.monotonic() - self.started

    def _steps_to_the_end(self) -> RoundPullResult:
        """``_steps``, then the call's log line and its result."""
        self._steps()
        r = self.result
        log.info(
            "round %s: %s ran %d range(s) (%d rows read, %d split(s) asked, %d won)%s",
            self.round_id,
            self.lineage or "this task",
            len(r.ranges),
            r.rows_read,
            r.splits_asked,
            r.splits_won,
            f"; yielding ({r.yielded})" if r.yielded else "; nothing left for it",
        )
        return r

    def _forget(self) -> None:
        """After a restore from the mirror: every set built from the round's state before it
        describes a state that is gone (a range this call finished may be open again, at its last
        mirrored cursor). Drop them; the steps read the round again."""
        log.warning("round %s: restored; this task reads the round again", self.round_id)
        self.finished.clear()
        self.seen_complete.clear()
        self.skipped.clear()
        self.declined.clear()
        self.busy_since.clear()

    def _steps(self) -> None:
        for range_id in self._held():
            if not self._take(range_id, "resuming (held by this task before)"):
                return
        first = self.first_range
        if first is not None and not self._take(first, "first range", self._first_share(first)):
            return
        while (nxt := self.store.next_unclaimed_of(self.round_id)) is not None:
            next_id, self.n_ranges = nxt
            if not self._take(next_id, _NEXT, self._share(next_id, next_id)):
                return
        while not self._over():
            briefs = self.store.open_briefs(self.round_id, self.seen_complete)
            orphan = self._orphan(briefs)
            if orphan is not None:
                share = self._share(orphan, self.n_ranges - len(briefs))
                if not self._take(orphan, "rescuing (not complete, no live owner)", share):
                    return
                continue
            if not self.split:
                return
            new_id = self._split(briefs)
            if new_id is None:
                return
            if new_id != _AGAIN and not self._take(new_id, "split off for this task"):
                return

    # -- the steps -------------------------------------------------------------------------------
    def _check_round(self) -> None:
        """Once per call: the round exists (restored from the mirror if Redis lost it) and was
        planned over this source; every range id the loop runs then comes from the store."""
        try:
            self.n_ranges = check_range(self.ctx, self.round_id, self.first_range or 0)
        except RoundStateLostError:
            if not self.ctx.control.restore(self.round_id):
                raise
            self.n_ranges = check_range(self.ctx, self.round_id, self.first_range or 0)

    def _first_share(self, first: int) -> int:
        """``_share`` of the first claim, stopping before the next task's first range (planned
        ranges are numbered in key order, and the plan spreads the first ranges with
        ``first_positions``), so that a task does not absorb where another one starts."""
        share = self._share(first, 0)
        if self.tasks:
            later = [p for p in first_positions(self.n_ranges, self.tasks) if p > first]
            if later:
                share = min(share, later[0] - first - 1)
        return share

    def _share(self, range_id: int, handed: int) -> int:
        """How many ranges a claim of ``range_id`` may absorb (see the module docstring):
        ``ceil(left / tasks) - 1``, ``left`` the ranges from ``handed`` on, capped by
        ``COALESCE_MAX`` and by the ids that exist after ``range_id``."""
        if not self.tasks:
            return 0
        left = max(self.n_ranges - handed, 1)
        share = -(-left // self.tasks) - 1
        return max(min(share, COALESCE_MAX, self.n_ranges - 1 - range_id), 0)

    def _over(self) -> bool:
        """A stop was requested, or the time budget is spent (recorded in the result)."""
        if self.ctx.stop.is_set():
            self.result.stopped = True
        elif self.deadline is not None and time.monotonic() >= self.deadline:
            self.result.yielded = BUDGET
        return self.result.stopped or bool(self.result.yielded)

    def _held(self) -> list[int]:
        if not self.lineage:
            return []
        held = self.store.held_by(self.round_id, self.lineage)
        return [] if held is None else [held]

    def _take(self, range_id: int, why: str, coalesce: int = 0) -> bool:
        """Run one range (skipped when a live owner holds it). False: the call ends here."""
        if self._over():
            return False
        if range_id in self.finished or range_id in self.skipped:
            return True
        # the routine step (the next unclaimed range) is logged by the claim itself
        level = logging.DEBUG if why == _NEXT else logging.INFO
        log.log(level, "round %s range %d: %s", self.round_id, range_id, why)
        try:
            res = run_restoring(
                self.ctx,
                self.round_id,
                range_id,
                self.processor,
                self.o,
                checked=True,  # by _check_round; the ids come from the store
                deadline=self.deadline,
                split=self.split,
                pacer=self.pacer,
                beats=self.beats,
                coalesce=coalesce,
                pull=True,
                on_restore=self._forget,
            )
        except LeaseHeldError:
            if self.ctx.stop.is_set():
                self.result.stopped = True
                return False
            log.info("round %s range %d: held by a live owner; skipped", self.round_id, range_id)
            return True
        if not (res.complete and not res.chunks and not res.rows_read):
            self.result.ranges.append(res)  # not a range that was complete when claimed
        if res.stopped or res.yielded:
            self.result.stopped, self.result.yielded = res.stopped, res.yielded
            self.result.retry_after = res.retry_after
            return False
        (self.finished if res.complete else self.skipped).add(range_id)
        return True

    def _orphan(self, briefs: Sequence[RangeBrief]) -> int | None:
        """A range that is not complete and has no live owner (None: there is none), picked at
        random, so idle tasks reading the same briefs do not all race for the same one."""
        orphans = [
            b.range_id
            for b in briefs
            if b.state != RangeState.COMPLETE
            and b.range_id not in self.skipped
            and b.range_id not in self.finished
            and not b.live_owner
        ]
        return random.choice(orphans) if orphans else None

    def _candidates(self, briefs: Sequence[RangeBrief]) -> list[RangeBrief]:
        """Running ranges worth splitting, the most work left first."""
        floor = SPLIT_MIN_CHUNKS * self.o.chunk_size
        ranked: list[tuple[float, RangeBrief]] = []
        for b in briefs:
            if b.state == RangeState.COMPLETE or b.range_id in self.declined:
                continue
            if not b.live_owner:
                continue
            left = remaining_rows(b)
            if left is not None and left < floor:
                continue
            ranked.append((math.inf if left is None else left, b))
        ranked.sort(key=lambda pair: -pair[0])
        return [b for _, b in ranked]

    def _split(self, briefs: Sequence[RangeBrief]) -> int | None:
        """Ask the best candidate to split: the new range's id, ``_AGAIN`` (read the briefs
        again), or None (nothing is left to split)."""
        busy = False
        for b in self._candidates(briefs):
            answer = self.store.request_split(self.round_id, b.range_id, self.requester)
            if answer == "asked":
                self.result.splits_asked += 1
                new_id = self._await_answer(b.range_id)
                if new_id is None:
                    self.declined.add(b.range_id)
                    return _AGAIN
                self.result.splits_won += 1
                return new_id
            if answer == "busy":  # another task's request is pending: it gets that half
                since = self.busy_since.setdefault(b.range_id, time.monotonic())
                if time.monotonic() - since > SPLIT_ANSWER_LEASES * self.o.lease_seconds:
                    self.declined.add(b.range_id)
                else:
                    busy = True
                continue
            if answer == "not_running":
                return _AGAIN  # complete, or its owner is gone: the rescue step sees it
            if answer == "closed":
                return None  # the round is closed: nothing is left to split
            raise RoundStateLostError(
                f"round {self.round_id} range {b.range_id}: the store answered {answer!r} to a "
                "split request; the round's state is lost"
            )
        if not busy:
            return None
        self.ctx.stop.wait(SPLIT_POLL_SECONDS)  # let the pending answers land, then look again
        return _AGAIN

    def _await_answer(self, range_id: int) -> int | None:
        """The new range's id once the owner split for us; None when it declined, lost its lease
        (checked every ``SPLIT_OWNER_CHECK_SECONDS``: a dead owner's range is rescued one lease
        after its last heartbeat, not after this wait), or did not answer within
        ``SPLIT_ANSWER_LEASES`` leases (it may still split later: the new range then has no owner
        and a rescue step claims it)."""
        limit = time.monotonic() + SPLIT_ANSWER_LEASES * self.o.lease_seconds
        checked = time.monotonic()
        poll = SPLIT_POLL_FIRST_SECONDS
        while True:
            if time.monotonic() - checked >= SPLIT_OWNER_CHECK_SECONDS:
                checked = time.monotonic()
                if not self._owner_alive(range_id):
                    return None
            answer = self.store.split_answer(self.round_id, range_id, self.requester)
            if answer is not None:
                if answer == "no":
                    log.info("round %s range %d: declined to split", self.round_id, range_id)
                    return None
                log.info("round %s range %d: split; new range %s", self.round_id, range_id, answer)
                return int(answer)
            if self._over() or time.monotonic() >= limit:
                log.info(
                    "round %s range %d: no answer to the split request; not asking it again",
                    self.round_id,
                    range_id,
                )
                return None
            self.ctx.stop.wait(poll)
            poll = min(poll * 2, SPLIT_POLL_SECONDS)

    def _owner_alive(self, range_id: int) -> bool:
        """The range is running under a live lease (on the Redis server's clock)."""
        rng = self.store.range(self.round_id, range_id)
        alive = (
            rng.get("state") == RangeState.RUNNING
            and bool(rng.get("owner"))
            and int(rng.get("lease_until") or 0) > self.store.server_time_ms()
        )
        if not alive:
            log.info(
                "round %s range %d: its owner is gone (lease expired or released) before "
                "answering the split request; rescuing it instead",
                self.round_id,
                range_id,
            )
        return alive


def first_positions(n_ranges: int, tasks: int) -> list[int]:
    """Where in key order each of ``tasks`` pull tasks starts (at most one per range): spread
    evenly, so that with coalescing each task's first claim takes its own share of the round."""
    k = min(n_ranges, tasks)
    return [i * n_ranges // k for i in range(k)]


__all__ = [
    "COALESCE_MAX",
    "SPLIT_ANSWER_LEASES",
    "SPLIT_POLL_SECONDS",
    "PullLoop",
    "RoundPullResult",
    "first_positions",
    "remaining_rows",
]
