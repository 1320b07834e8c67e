"""One claimed range, traversed from its committed cursor to ``hi``, then its item-retry passes.

``run_range`` (``traverse.py``) claims the range (waiting while a live owner holds it), starts a
``Heartbeat``, hands over to ``RangeRun.run`` and releases the lease. ``run`` reads
as the loop it is: next rows, process them, add their outcome to the group, commit the group when
it is due (the commit, the checkpoint mirror and the backoff are ``RangeCommits``, in
``core/run/commits.py``; answering a split request, ``core/run/split.py``). Everything here keeps the
engine's contract:

- The cursor moves only by ``CursorStore.advance`` (fenced by the owner token, together with the
  counters); ``read`` (how far this worker has processed) runs ahead of the committed cursor by
  at most one group, which is what a crash replays.
- A dependency failure (a failed read, ``RetryableError``, or a chunk that failed as a whole and
  whose isolation found no sign of a working dependency, see ``item_failures``) commits what was
  processed, backs off and reads the same chunk again; after ``max_chunk_attempts`` it raises with
  the cursor unchanged.
- An item failure (named by the processor, or an item that fails alone in isolation) is recorded
  with the chunk; the cursor moves on, and the retry passes at the end (``item_failures``) give
  the item ``max_item_attempts`` in all before it is dead-lettered.
- The lease follows progress: a processor call running past ``chunk_timeout`` stops the
  heartbeat (``call_processor``), so another try can take the range over; this one is fenced.
- Every wait (backoff, retry passes) ends at once on ``request_stop``; the run commits what it
  processed and returns ``stopped``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

from ..chunk import Processor
from ..errors import (
    KeysetError,
    RetryableError,
)
from ..keys import display_key, encode_key
from ..options import TraverseOptions
from ..pace.adaptive import ChunkSizer
from ..pace.stream_control import Pace, Pacer
from ..sql.source import release
from ..store.cursor_store import Claim
from .commits import RangeCommits
from .item_failures import IsolationStopped, ItemFailures
from .split import Splitter
from .state import (
    CommittedRange,
    Group,
    Heartbeat,
    ProgressLog,
    Verdict,
)

if TYPE_CHECKING:
    from .context import RunContext

log = logging.getLogger("airflow_keyset_provider")

#: ``RangeResult.yielded`` when the call's ``max_task_seconds`` budget was spent.
BUDGET = "budget"


class RangeRun(RangeCommits):
    """One claimed range, from its cursor to ``hi``, then the item-retry passes."""

    heart: Heartbeat  # set by ``run``
    deadline: float | None = None  # time.monotonic() past which the run yields "budget"

    def __init__(
        self,
        ctx: RunContext,
        round_id: str,
        range_id: int,
        processor: Processor,
        claim: Claim,
        hi: str,
        options: TraverseOptions,
        pacer: Pacer | None = None,
    ) -> None:
        self.ctx, self.store, self.source = ctx, ctx.store, ctx.source
        self.pacer = pacer
        self.yielded = ""  # set when the pacer ended the run early ("paused", "throttled")
        self.charged = 0  # rows_read already charged to the stream's budget
        self.size = options.chunk_size  # rows of the next read (adaptive with a target)
        self.sizer = (
            ChunkSizer(
                options.chunk_size,
                options.target_chunk_seconds,
                options.min_chunk_size,
                options.max_chunk_size,
            )
            if options.target_chunk_seconds is not None
            else None
        )
        self.paced_at = time.monotonic()
        self.round_id, self.range_id, self.hi = round_id, range_id, hi
        self.processor, self.token, self.o = processor, claim.token, options
        self.state = CommittedRange(
            claim.cursor, claim.done, claim.skipped, claim.dead, claim.retries
        )
        self.key_of = self.source.key_of()
        self.arity = self.source.arity
        self.rows_read = 0  # rows read by this call, replays included
        self.chunks = 0  # commits by this call
        self.last_checkpoint = time.monotonic()
        # ``read`` is how far this worker has processed; the committed cursor (``state.cursor``)
        # catches up at every flush. With group commit off (the default) they never differ
        # between chunks, so a crash replays at most one chunk; with it, at most one group.
        self.read = claim.cursor
        self.group = Group()
        self.attempt = 0  # consecutive failures of the chunk in hand
        self.pool: ThreadPoolExecutor | None = None
        self.pending: Future[Sequence[tuple]] | None = None  # the prefetched next chunk
        self.items = ItemFailures(self)  # failure isolation and item retry passes
        self.splitter = Splitter(self, False)  # answers split requests (``split.py``)
        hi_label = display_key(hi, self.arity)
        self.progress = ProgressLog(
            round_id,
            range_id,
            hi_label,
            self.arity,
            options.log_every_seconds,
            None,
            self._estimate,
        )

    def _estimate(self) -> int | None:
        """Rows read so far plus the source's estimate of the rows left (for the ETA)."""
        try:
            left = self.source.estimate_rows(self.read, self.hi) if self.read != self.hi else 0
        except Exception:  # an estimate is a nicety; never fail the range for it
            log.debug("no row estimate for the ETA", exc_info=True)
            return None
        return self.progress.rows + left

    # -- the loop --------------------------------------------------------------------------------
    def run(self, heart: Heartbeat) -> CommittedRange:
        """Traverse to ``hi``, then retry failed items; return the committed state."""
        self.heart = heart
        if self.o.prefetch:
            self.pool = ThreadPoolExecutor(1, thread_name_prefix="keyset-prefetch")
        try:
            while self.read != self.hi:
                self._check_lease(heart, "lease lost; stopping")
                if self.ctx.stop.is_set() or not self._pace():
                    return self._stop_here()
                if self._skip_committed():
                    continue  # exactly_once: keys another identity committed, passed over
                rows = self._next_rows()
                if rows is None:
                    continue  # the read failed and was backed off: read again
                if not rows:
                    self._flush()
                    bound = self._bound(self.read)
                    self._commit(bound, 0, 0)  # nothing left up to the bound: read to there
                    self.read = bound
                    if bound == self.hi:
                        break
                    continue
                verdict = self._process(rows)
                if verdict is None:
                    continue  # a dependency failed and was backed off: the same chunk again
                self._check_lease(heart, "lease lost; chunk not committed")
                self._add_to_group(rows, verdict)
                if self._group_due():
                    self._flush()
                self._tick(len(rows))
            self._flush()
            if self.items.drain(heart):
                return self._stop_here()
        except BaseException as exc:
            if not isinstance(exc, Exception):
                self._flush_interrupted(exc)
            raise
        finally:
            if self.pool is not None:
                self.pool.shutdown(wait=True, cancel_futures=True)
        self.progress.tick(0, self.state.cursor, self.state, force=True)
        self.checkpoint(force=True)
        return self.state

    # -- the steps -------------------------------------------------------------------------------
    def _pace(self) -> bool:
        """Before each chunk read: size the next chunk (adaptive, opt-in) from the last one's
        duration, then the stream's pause, health and throughput budget (``Pacer``: a local flag,
        plus Redis calls only while a rate or health checks are set). False: stop here."""
        if self.deadline is not None and self.rows_read and time.monotonic() >= self.deadline:
            self.yielded = BUDGET  # budget spent (after a chunk at least): commit, release, return
            return False
        rows, self.charged = self.rows_read - self.charged, self.rows_read
        if self.sizer is not None and rows:
            self.size = self.sizer.observe(rows, time.monotonic() - self.paced_at)
        outcome = self.pacer.gate(rows) if self.pacer is not None else Pace.GO
        self.paced_at = time.monotonic()  # waiting for the pacer is not the chunk's time
        if outcome in (Pace.PAUSED, Pace.THROTTLED, Pace.UNHEALTHY):
            self.yielded = outcome
        return outcome == Pace.GO

    def _stop_here(self) -> CommittedRange:
        """A stop was requested (or the stream is paused): commit what was processed, return."""
        self._flush()
        health = self.pacer.health_reason if self.pacer else ""
        why = {
            Pace.PAUSED: "stream paused",
            Pace.THROTTLED: "throttled; yielding",
            Pace.UNHEALTHY: f"unhealthy ({health}); yielding",
            BUDGET: "time budget (max_task_seconds) spent; yielding",
        }
        log.info(
            "round %s range %d: %s; committed through %s",
            self.round_id,
            self.range_id,
            why.get(self.yielded, "stop requested"),
            display_key(self.state.cursor, self.arity),
        )
        self.state.stopped = not self.yielded
        self.checkpoint(force=True)
        return self.state

    def _next_rows(self) -> Sequence[tuple] | None:
        """The rows after ``read`` (prefetched, if they were); None after a failed read."""
        pending, self.pending = self.pending, None
        try:
            if pending is not None:
                return pending.result()
            return self.source.fetch(self.read, self._bound(self.read), self.size)
        except Exception as exc:  # the source is a dependency too
            self._flush()
            self.attempt += 1
            self.source.reset()
            self._backoff(self.attempt, "reading the chunk", exc)
            return None

    def _process(self, rows: Sequence[tuple]) -> Verdict | None:
        """Hand the rows to the processor (isolating a chunk that fails as a whole, see
        ``item_failures``); None after a dependency failure (backed off) or a stop request."""
        self.rows_read += len(rows)
        last = encode_key(tuple(rows[-1][: self.arity]))
        bound = self._bound(last)
        if self.pool is not None and last < bound:
            self.pending = self.pool.submit(self.source.fetch, last, bound, self.size)
        try:
            failed, skipped = self.items.process(rows, self.attempt + 1)
        except IsolationStopped:
            release(rows)
            self._drop_prefetched()
            self._drop_attempt()
            return None  # the loop sees the stop request and commits what it has
        except Exception as exc:
            # RetryableError, or anything unexpected (a failed read while isolating), is a
            # dependency failure: the cursor stays and the chunk is read again. The engine's own
            # errors are not.
            if isinstance(exc, KeysetError) and not isinstance(exc, RetryableError):
                raise
            release(rows)
            self._drop_prefetched()
            self._drop_attempt()
            self._flush()
            self.attempt += 1
            what = (
                "the processor's dependency" if isinstance(exc, RetryableError) else "the processor"
            )
            self._backoff(self.attempt, what, exc)
            return None
        self.attempt = 0
        return Verdict(last, failed, skipped)

    def _add_to_group(self, rows: Sequence[tuple], verdict: Verdict) -> None:
        for enc, reason in verdict.failed.items():
            log.warning(
                "round %s range %d: item %s failed: %s",
                self.round_id,
                self.range_id,
                display_key(enc, self.arity),
                reason,
            )
        done = len(rows) - len(verdict.failed) - len(verdict.skipped)
        self.group.add(done, len(verdict.skipped), verdict.failed.items())
        self.items.note_done(rows, verdict.last, {*verdict.failed, *verdict.skipped})
        release(rows)
        self.read = verdict.last

    def _group_due(self) -> bool:
        """Commit now? Every chunk by default; with group commit, every N chunks or T seconds (a
        chunk limit of 1 with a time limit means "by time only")."""
        chunks, seconds = self.o.group_commit_chunks, self.o.group_commit_seconds
        by_count = chunks > 1 or seconds is None
        if by_count and self.group.chunks >= chunks:
            return True
        return seconds is not None and time.monotonic() - self.group.since >= seconds

    def _flush(self) -> None:
        """Commit the processed group: the cursor moves to ``read`` with its counters. With
        exactly_once, a ledger step that lost its transaction (a deadlock) loses the group's
        writes: the run rewinds to the committed cursor and backs off (a dependency failure)."""
        if self.group.chunks:
            g = self.group
            try:
                self._commit(self.read, g.done, g.skipped, failed=sorted(g.failed))
            except RetryableError as exc:
                self._rewind()
                self.attempt += 1
                self._backoff(self.attempt, "the target's ledger step", exc)
                return
            g.reset()

    def _drop_attempt(self) -> None:
        """The chunk's attempt ended without a verdict: with exactly_once its writes are rolled
        back (a smaller or different re-read of the same keys must not find them); when that
        lost the whole transaction, the uncommitted group is read again too."""
        if self.ledger is not None and self.ledger.drop_attempt():
            self._rewind()

    def _rewind(self) -> None:
        """The target's transaction was lost with the group's writes: read from the committed
        cursor again."""
        self.group.reset()
        self.read = self.state.cursor
        self._drop_prefetched()

    def _flush_interrupted(self, exc: BaseException) -> None:
        """A ``BaseException`` (Airflow's ``AirflowTaskTimeout`` from ``execution_timeout``, a
        ``KeyboardInterrupt``) passes through the loop: commit the chunks processed so far (a
        group not yet due) before it goes on. The chunk whose processor call it interrupted is
        not in the group (not processed): the next try reads it again."""
        if not self.group.chunks:
            return
        try:
            self._flush()
        except Exception:  # the interruption goes on; the uncommitted group is replayed
            log.warning(
                "round %s range %d: could not commit the processed chunks on %s",
                self.round_id,
                self.range_id,
                type(exc).__name__,
                exc_info=True,
            )
            return
        log.info(
            "round %s range %d: %s; committed through %s",
            self.round_id,
            self.range_id,
            type(exc).__name__,
            display_key(self.state.cursor, self.arity),
        )

    def _tick(self, n_rows: int) -> None:
        s, g = self.state, self.group
        with_group = CommittedRange(
            s.cursor, s.done + g.done, s.skipped + g.skipped, s.dead, s.retries
        )
        self.progress.tick(n_rows, self.read, with_group)

    def _drop_prefetched(self) -> None:
        """Discard a prefetched chunk: after a failure the same chunk is read again."""
        pending, self.pending = self.pending, None
        if pending is not None:
            pending.cancel()
            try:
                release(pending.result())
            except Exception:
                log.debug("prefetch discarded", exc_info=True)


__all__ = ["BUDGET", "RangeRun"]
