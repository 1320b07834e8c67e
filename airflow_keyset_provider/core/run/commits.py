"""The commit side of a range run: the processor call under the progress-based lease, the fenced
advance of what was processed, with its counters and metrics; the answer to a split request that the advance carries back (``core/run/split.py``); the
durable checkpoint mirror; the backoff after a dependency failure.

``RangeRun`` (``core/run/range_run.py``) inherits ``RangeCommits``; the attributes declared below are set
by ``RangeRun.__init__``. Failure isolation (``item_failures.py``) and the owner's split
(``split.py``) work on a run through this class, so neither imports the loop (``range_run.py``).
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Protocol

from ..chunk import Chunk, Processor
from ..db_reasons import describe_exception
from ..errors import (
    CursorConflictError,
    DependencyFailedError,
    LeaseLostError,
    RetryableError,
    RoundStateLostError,
)
from ..keys import display_key, encode_key
from ..options import TraverseOptions
from ..sql.dialects import for_engine
from ..store.cursor_store import Advanced, CursorStore
from .claim import mirror_coalesced
from .state import CommittedRange

if TYPE_CHECKING:
    from ..pace.stream_control import Pacer
    from ..sql.source import SqlSource
    from .context import RunContext
    from .ledger import RunLedger
    from .state import Heartbeat, ProgressLog

log = logging.getLogger("airflow_keyset_provider")


class SplitAnswerer(Protocol):
    """Answers the split request a commit carried back (``split.Splitter``)."""

    def answer(self, requester: str) -> None: ...


class RangeCommits:
    """Commits, checkpoints and backoff of one claimed range (mixed into ``RangeRun``)."""

    ctx: RunContext
    store: CursorStore
    source: SqlSource
    hi: str  # the range's end (lowered by a split)
    read: str  # how far this worker has processed (ahead of the committed cursor by a group)
    size: int  # rows of the next read
    pending: Future[Sequence[tuple]] | None  # the prefetched next chunk
    key_of: Callable[[tuple], Any]
    processor: Processor
    progress: ProgressLog
    _failing_since: float | None = None  # monotonic time of the current failure streak's first
    round_id: str
    range_id: int
    token: str
    o: TraverseOptions
    arity: int
    state: CommittedRange
    chunks: int
    last_checkpoint: float
    splitter: SplitAnswerer
    heart: Heartbeat
    pacer: Pacer | None  # the stream's pause, throttle and health (``core/pace``)
    released: bool = False  # the completing advance released the lease (nothing left to do)
    ledger: RunLedger | None = None  # exactly_once: the target's transaction and ledger row
    probing: bool = False  # a canary call (isolation): its writes are always rolled back

    def _pace(self) -> bool:
        """Go on with the next chunk or item retry pass? ``RangeRun`` consults the pacer and the
        time budget (False: commit, release, return with ``yielded`` set)."""
        return True

    def _flush(self) -> None:
        """Commit the processed group (``RangeRun``; nothing to flush here)."""

    def _check_lease(self, heart: Heartbeat, what: str) -> None:
        if heart.lost.is_set():
            raise LeaseLostError(f"round {self.round_id} range {self.range_id}: {what}")

    def call_processor(self, chunk: Chunk) -> Any:
        """Call the processor under the progress-based lease: while it runs longer than
        ``chunk_timeout`` the heartbeat stops, and a call that returns after that fails the try
        with ``LeaseLostError`` (another try may own the range by then; this one is fenced)."""
        started = time.monotonic()
        self.heart.busy()
        try:
            result = self._call_in_target(chunk)
        except BaseException:
            self._after_call(chunk, started)
            raise
        self._after_call(chunk, started)
        return result

    def _call_in_target(self, chunk: Chunk) -> Any:
        """The processor call; with a target database, inside a transaction of its own that
        commits when the processor returns and rolls back when it raises (``chunk.connection``)."""
        target = self.ctx.target
        if self.ledger is not None:  # exactly_once: a SAVEPOINT of the range's transaction
            return self.ledger.call(self, chunk)
        if target is None:
            return self.processor(chunk)
        try:
            with target.begin() as conn:
                chunk.connection = conn
                try:
                    return self.processor(chunk)
                finally:
                    chunk.connection = None
        except Exception as exc:  # a deadlock, lock wait timeout...: a dependency failure
            dialect = for_engine(target.dialect)
            if dialect is not None and dialect.classify_row_error(exc) == "retry":
                raise RetryableError(f"the target failed ({type(exc).__name__}: {exc})") from exc
            raise

    def _after_call(self, chunk: Chunk, started: float) -> None:
        self.heart.idle()
        elapsed = time.monotonic() - started
        self.ctx.metrics.timing("chunk.process", elapsed * 1000, tags=self.ctx.tags)
        if not self.heart.overrun.is_set():
            return
        first, last = (
            display_key(encode_key(tuple(v[: self.arity])), self.arity)
            for v in (chunk.values[0], chunk.values[-1])
        )
        raise LeaseLostError(
            f"round {self.round_id} range {self.range_id}: the processor ran {elapsed:.1f} s on "
            f"the chunk of keys {first} .. {last} ({len(chunk)} keys), past "
            f"chunk_timeout={self.o.chunk_timeout_seconds:g} s. Heartbeats stopped at "
            "chunk_timeout so the lease could lapse and another try take the range over; this "
            "try is fenced and nothing of the chunk was committed. If chunks legitimately take "
            "this long, raise chunk_timeout (or lower chunk_size); otherwise find where the "
            "processor hangs (a lock wait, a call without a timeout)."
        )

    def _backoff(self, attempt: int, what: str, exc: BaseException) -> None:
        """Wait before the next attempt after a dependency failure (``attempt``: failures in a
        row, 1 starts the streak), or raise ``DependencyFailedError`` once the streak spent its
        budget: ``retry_budget_seconds`` since its first failure, or ``max_chunk_attempts``
        failures when set. A backoff never waits past the time budget."""
        self.ctx.metrics.incr("dependency.failure", tags=self.ctx.tags)
        cursor = display_key(self.state.cursor, self.arity)
        last = describe_exception(exc)  # a database error's class, never its values (db_reasons)
        now = time.monotonic()
        since = self._failing_since
        if attempt <= 1 or since is None:
            since = self._failing_since = now
        budget = self.o.retry_budget_seconds
        elapsed = now - since
        left = budget - elapsed
        limit = self.o.max_chunk_attempts
        if left <= 0 or (limit is not None and attempt >= limit):
            self._failing_since = None
            spent = (
                f"max_chunk_attempts={limit} reached after {elapsed:.1f} s"
                if limit is not None and attempt >= limit
                else f"retry_budget_seconds={budget:g} spent"
            )
            raise DependencyFailedError(
                f"round {self.round_id} range {self.range_id}: {what} failed {attempt} times in a "
                f"row (last: {last}); the cursor stays at {cursor}, nothing "
                "was skipped. An Airflow retry (or a new traverse) resumes from there. The retry "
                f"budget is spent ({spent})." + self._own_bug_hint(what)
            ) from exc
        delay = min(self.o.backoff_max, self.o.backoff_base * 2 ** (attempt - 1))
        delay = min(delay * random.uniform(0.5, 1.0), left)
        log.warning(
            "round %s range %d: %s failed (attempt %d%s, %.0f s of the %g s retry budget left): "
            "%s; cursor stays at %s, retrying in %.2f s",
            self.round_id,
            self.range_id,
            what,
            attempt,
            f"/{limit}" if limit is not None else "",
            left,
            budget,
            last,
            cursor,
            delay,
        )
        self.ctx.stop.wait(delay)  # a stop request ends the wait; the caller then stops

    @staticmethod
    def _own_bug_hint(what: str) -> str:
        """What to check when the failing "dependency" may be the processor itself."""
        if "processor" not in what:
            return ""
        return (
            " If the processor fails for every row (not only while a database or service is "
            "down), the bug may be the processor's own: run it on one chunk with "
            "airflow_keyset_provider.testing.run_processor, or read the first traceback in "
            "this log; an exception that names the row should be raised per item "
            "(ChunkResult(failed=...)), a real outage as RetryableError."
        )

    def _commit(
        self,
        new: str,
        done: int,
        skipped: int,
        resolved: Sequence[tuple[str, str]] = (),
        failed: Sequence[tuple[str, str]] = (),
    ) -> None:
        """Advance the cursor from the committed one to ``new`` with the counters (fenced)."""
        metrics, tags = self.ctx.metrics, self.ctx.tags
        started = time.perf_counter()
        try:
            if self.ledger is not None:  # exactly_once: the ledger row commits with the writes
                self.ledger.commit(self, new, done, skipped, failed, resolved)
            with self.heart.lock:  # no beat in flight while this step may release the range
                a = self._advance(new, done, skipped, resolved, failed)
                if a.released:
                    self.heart.stop()
        except (LeaseLostError, CursorConflictError):
            metrics.incr("advance.refused", tags=tags)
            raise
        metrics.timing("chunk.commit", (time.perf_counter() - started) * 1000, tags=tags)
        metrics.incr("chunks", tags=tags)
        self._committed(a)

    def _committed(self, a: Advanced) -> None:
        """After an advance: the counters' metrics, the committed state, the checkpoint, the
        split request it carried back, the dead letters it made."""
        metrics, tags = self.ctx.metrics, self.ctx.tags
        before = self.state
        for name, delta in (
            ("rows.done", a.done - before.done),
            ("rows.skipped", a.skipped - before.skipped),
            ("rows.dead", a.dead - before.dead),
        ):
            if delta:
                metrics.incr(name, delta, tags=tags)
        self.state = CommittedRange(a.cursor, a.done, a.skipped, a.dead, a.retries, a.complete)
        self.released = a.released
        self.chunks += 1
        self.checkpoint(force=a.complete)
        if a.split_req:  # an idle task asks this range to split: answer at this boundary
            self.splitter.answer(a.split_req)
        if a.dead > before.dead:
            log.error(
                "round %s range %d: %d item(s) dead-lettered after %d attempts (see dead letters)",
                self.round_id,
                self.range_id,
                a.dead - before.dead,
                self.o.max_item_attempts,
            )

    def _skip_committed(self) -> bool:
        """exactly_once: at the start of a key interval another identity of these keys
        committed (``ledger.py``), flush the group, then move the cursor over the interval in
        one fenced advance with its counters and failed items. True when it did."""
        ledger = self.ledger
        skip = ledger.due(self.read, self.hi) if ledger is not None else None
        if ledger is None or skip is None:
            return False
        self._flush()
        if self.state.cursor != skip.start:  # the group's transaction was lost: read it first
            ledger.skips.insert(0, skip)
            return True
        with self.heart.lock:
            a = self.store.advance(
                self.round_id,
                self.range_id,
                self.token,
                self.state.cursor,
                skip.to,
                done=skip.done,
                skipped=skip.skipped,
                lease_ms=self.o.lease_ms,
                max_item_attempts=self.o.max_item_attempts,
                dead_cap=self.o.dead_cap,
                failed=skip.failed,
                release=True,
            )
            if a.released:
                self.heart.stop()
        self.ctx.metrics.incr("ledger.skipped_interval", tags=self.ctx.tags)
        log.info(
            "round %s range %d: keys (%s, %s] were committed by another identity of this range "
            "(a split, coalescing, restore or failover); passed over without reading",
            self.round_id,
            self.range_id,
            display_key(skip.start, self.arity),
            display_key(skip.to, self.arity),
        )
        self.read = a.cursor  # before a split request it carried is answered
        self._committed(a)
        return True

    def _bound(self, read: str) -> str:
        """How far a read from ``read`` may go: ``hi``, or the next interval committed by
        another identity of these keys (exactly_once)."""
        return self.ledger.bound(read, self.hi) if self.ledger is not None else self.hi

    def _advance(
        self,
        new: str,
        done: int,
        skipped: int,
        resolved: Sequence[tuple[str, str]],
        failed: Sequence[tuple[str, str]],
    ) -> Advanced:
        return self.store.advance(
            self.round_id,
            self.range_id,
            self.token,
            self.state.cursor,
            new,
            done=done,
            skipped=skipped,
            lease_ms=self.o.lease_ms,
            max_item_attempts=self.o.max_item_attempts,
            dead_cap=self.o.dead_cap,
            resolved=resolved,
            failed=failed,
            release=True,  # the step that completes the range releases it too
        )

    def checkpoint(self, force: bool = False) -> None:
        """Mirror the committed state durably, at most every ``checkpoint_seconds``."""
        self.ctx.progress(self.state, force)  # the caller's on_progress, throttled by itself
        mirror = self.ctx.mirror
        if mirror is None:
            return
        if not force and time.monotonic() - self.last_checkpoint < self.ctx.checkpoint_seconds:
            return
        self.last_checkpoint = time.monotonic()
        try:
            snapshot = self.store.snapshot_range(self.round_id, self.range_id)
            if snapshot.get("unmirrored"):  # the mirror missed this range's coalescing
                mirror_coalesced(
                    self.ctx, self.round_id, self.range_id, int(snapshot["unmirrored"])
                )
                return
            mirror.save_range(self.ctx.stream, self.round_id, self.range_id, snapshot)
        except RoundStateLostError:
            raise
        except Exception as exc:  # the mirror is a safety net; its outage must not stop the range
            log.warning(
                "round %s range %d: checkpoint mirror write failed: %s",
                self.round_id,
                self.range_id,
                exc,
            )


__all__ = ["RangeCommits"]
