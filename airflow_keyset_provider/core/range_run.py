"""One claimed range, traversed from its committed cursor to ``hi``, then its item-retry passes.

``KeysetTraversal.traverse`` calls ``run_range``: claim the range (waiting while a live owner
holds it), start a ``Heartbeat``, hand over to ``RangeRun.run``, release the lease. ``run`` reads
as the loop it is: next rows, process them, add their outcome to the group, commit the group when
it is due. Everything here keeps the engine's contract:

- The cursor moves only by ``CursorStore.advance`` (fenced by the owner token, together with the
  counters); ``read`` (how far this worker has processed) runs ahead of the committed cursor by
  at most one group, which is what a crash replays.
- A dependency failure (a failed read, ``RetryableError``, any unexpected exception, or more
  failed items than ``outage_failure_ratio`` allows) commits what was processed, backs off and
  reads the same chunk again; after ``max_chunk_attempts`` it raises with the cursor unchanged.
- An item failure is recorded with the chunk; the cursor moves on, and the retry passes at the
  end give the item ``max_item_attempts`` in all before it is dead-lettered.
"""

from __future__ import annotations

import logging
import random
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from .adaptive import ChunkSizer
from .chunk import Chunk, ChunkResult, Processor
from .errors import (
    CursorConflictError,
    DependencyFailedError,
    KeysetError,
    LeaseHeldError,
    LeaseLostError,
    ProcessorContractError,
    RetentionError,
    RetryableError,
    RoundStateLostError,
)
from .health import HealthGate
from .keys import as_tuple, display_key, encode_key
from .options import TraverseOptions
from .run_state import Group, Heartbeat, ProgressLog, RangeResult, RangeState, Verdict
from .source import release
from .store import Claim
from .stream_control import Pace, Pacer

if TYPE_CHECKING:
    from .traversal import KeysetTraversal

log = logging.getLogger("airflow_keyset_provider")


def run_range(
    t: KeysetTraversal, round_id: str, range_id: int, processor: Processor, o: TraverseOptions
) -> RangeResult:
    """Claim the range (waiting while a live owner holds it), refuse it if the source's retention
    passed its cursor, run it with a heartbeat, release the lease. Returns its counters."""
    token = f"{o.owner_lineage or 'worker'}#{uuid.uuid4().hex[:12]}"
    claim = _claim(t, round_id, range_id, token, o)
    started = time.monotonic()
    if claim.complete:
        log.info(
            "round %s range %d is already complete (done %d, skipped %d, dead %d)",
            round_id,
            range_id,
            claim.done,
            claim.skipped,
            claim.dead,
        )
        return RangeResult(
            round_id, range_id, claim.done, claim.skipped, claim.dead, True, claim.cursor
        )
    _check_retention(t, round_id, range_id, token, claim.cursor)
    rng = t.store.range(round_id, range_id)
    _log_claim(t, round_id, range_id, claim, rng)
    pacer = Pacer(
        t.store,
        poll_seconds=o.control_poll_seconds,
        yield_after=o.yield_after_seconds,
        chunk_rows=o.chunk_size,
        stop=t._stop,
        health=(
            HealthGate(t.store, o.health_checks, t.source.engine, o.health_poll_seconds)
            if o.health_checks
            else None
        ),
    )
    run = RangeRun(t, round_id, range_id, processor, claim, rng["hi"], o, pacer)
    heart = Heartbeat(t.store, round_id, range_id, token, o.lease_ms)
    heart.start()
    pacer.start()
    try:
        state = run.run(heart)
    finally:
        pacer.stop()
        heart.stop()
        try:
            t.store.release(round_id, range_id, token)
        except KeysetError:
            log.warning(
                "round %s range %d: could not release the lease; it expires by itself",
                round_id,
                range_id,
            )
    return RangeResult(
        round_id,
        range_id,
        state.done,
        state.skipped,
        state.dead,
        state.complete,
        state.cursor,
        run.rows_read,
        run.chunks,
        state.stopped,
        claim.takeover,
        time.monotonic() - started,
        run.yielded == Pace.PAUSED,
        run.yielded,
        pacer.retry_after if run.yielded != Pace.PAUSED else 0.0,
    )


def _claim(
    t: KeysetTraversal, round_id: str, range_id: int, token: str, o: TraverseOptions
) -> Claim:
    """Claim the range; while a live owner holds it, wait (on the traversal's stop event) until
    its lease runs out, up to ``claim_timeout``."""
    timeout, lease_ms = o.claim_timeout_seconds, o.lease_ms
    deadline = time.monotonic() + timeout
    while True:
        res = t.store.claim(round_id, range_id, token, o.owner_lineage, lease_ms)
        if isinstance(res, Claim):
            return res
        owner, ms_left = res.owner, res.ms_left
        if time.monotonic() + ms_left / 1000 > deadline + lease_ms / 1000:
            raise LeaseHeldError(
                f"round {round_id} range {range_id} is held by live owner {owner} (lease "
                f"renewed by heartbeats); gave up after {timeout:.0f} s. If that worker is "
                "gone, its lease expires by itself; otherwise let it finish."
            )
        if time.monotonic() > deadline:
            raise LeaseHeldError(
                f"round {round_id} range {range_id} is still held by {owner} after {timeout:.0f} s"
            )
        log.info(
            "round %s range %d is held by %s for %.1f s more; waiting",
            round_id,
            range_id,
            owner,
            ms_left / 1000,
        )
        if t._stop.wait(min(ms_left / 1000 + 0.05, max(deadline - time.monotonic(), 0.05))):
            raise LeaseHeldError(
                f"stop requested while waiting for round {round_id} range {range_id}"
            )


def _check_retention(
    t: KeysetTraversal, round_id: str, range_id: int, token: str, cursor: str
) -> None:
    """If the source may already have deleted keys this range has not read, the round is lost
    for good: mark it unrecoverable (it can never close) and stop."""
    boundary = t.source.retention_boundary()
    if boundary is None or boundary <= cursor:
        return
    reason = (
        f"the source's retention boundary {display_key(boundary, t.arity)} passed range "
        f"{range_id}'s cursor {display_key(cursor, t.arity)}: keys in between may have "
        "been deleted unread"
    )
    if not t.store.mark_unrecoverable(round_id, reason):
        log.warning("round %s: already closed or gone; not marked unrecoverable", round_id)
    t.store.release(round_id, range_id, token)
    log.error("round %s: %s; the round is marked unrecoverable", round_id, reason)
    raise RetentionError(
        f"round {round_id}: {reason}. It is marked unrecoverable and will never be reported "
        "complete. Keep rows above the stream's retention floor (airflow-keyset status) until "
        "rounds finish, then reset this round and plan again."
    )


def _log_claim(
    t: KeysetTraversal, round_id: str, range_id: int, claim: Claim, rng: dict[str, Any]
) -> None:
    if claim.takeover:
        t.metrics.incr("lease.takeover", tags=t.tags)
        log.warning(
            "round %s range %d: took over from a previous owner at cursor %s (that owner is "
            "fenced; up to one chunk will be replayed)",
            round_id,
            range_id,
            display_key(claim.cursor, t.arity),
        )
    else:
        log.info(
            "round %s range %d: claimed (%s, %s], resuming at cursor %s",
            round_id,
            range_id,
            display_key(rng["lo"], t.arity),
            display_key(rng["hi"], t.arity),
            display_key(claim.cursor, t.arity),
        )


class RangeRun:
    """One claimed range, from its cursor to ``hi``, then the item-retry passes."""

    def __init__(
        self,
        t: KeysetTraversal,
        round_id: str,
        range_id: int,
        processor: Processor,
        claim: Claim,
        hi: str,
        options: TraverseOptions,
        pacer: Pacer | None = None,
    ) -> None:
        self.t, self.store, self.source = t, t.store, t.source
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
        self.state = RangeState(claim.cursor, claim.done, claim.skipped, claim.dead, claim.retries)
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
        hi_label = display_key(hi, self.arity)
        self.progress = ProgressLog(
            round_id, range_id, hi_label, self.arity, options.log_every_seconds, self._estimate()
        )

    def _estimate(self) -> int | None:
        try:
            return self.source.estimate_rows(self.read, self.hi) if self.read != self.hi else 0
        except Exception:  # an estimate is a nicety; never fail the range for it
            log.debug("no row estimate for the ETA", exc_info=True)
            return None

    # -- the loop --------------------------------------------------------------------------------
    def run(self, heart: Heartbeat) -> RangeState:
        """Traverse to ``hi``, then retry failed items; return the committed state."""
        if self.o.prefetch:
            self.pool = ThreadPoolExecutor(1, thread_name_prefix="keyset-prefetch")
        try:
            while self.read != self.hi:
                self._check_lease(heart, "lease lost; stopping")
                if self.t._stop.is_set() or not self._pace():
                    return self._stop_here()
                rows = self._next_rows()
                if rows is None:
                    continue  # the read failed and was backed off: read again
                if not rows:
                    self._flush()
                    self._commit(self.hi, 0, 0)  # nothing left up to hi: the range is read
                    break
                verdict = self._process(rows)
                if verdict is None:
                    continue  # a dependency failed and was backed off: the same chunk again
                self._check_lease(heart, "lease lost; chunk not committed")
                self._add_to_group(rows, verdict)
                if self._group_due():
                    self._flush()
                self._tick(len(rows))
            self._flush()
            self._drain_retries(heart)
        finally:
            if self.pool is not None:
                self.pool.shutdown(wait=True, cancel_futures=True)
        self.progress.tick(0, self.state.cursor, self.state, force=True)
        self.checkpoint(force=True)
        return self.state

    # -- the steps -------------------------------------------------------------------------------
    def _check_lease(self, heart: Heartbeat, what: str) -> None:
        if heart.lost.is_set():
            raise LeaseLostError(f"round {self.round_id} range {self.range_id}: {what}")

    def _pace(self) -> bool:
        """Before each chunk read: size the next chunk (adaptive, opt-in) from the last one's
        duration, then the stream's pause, health and throughput budget (``Pacer``: a local flag,
        plus Redis calls only while a rate or health checks are set). False: stop here."""
        rows, self.charged = self.rows_read - self.charged, self.rows_read
        if self.sizer is not None and rows:
            self.size = self.sizer.observe(rows, time.monotonic() - self.paced_at)
        outcome = self.pacer.gate(rows) if self.pacer is not None else Pace.GO
        self.paced_at = time.monotonic()  # waiting for the pacer is not the chunk's time
        if outcome in (Pace.PAUSED, Pace.THROTTLED, Pace.UNHEALTHY):
            self.yielded = outcome
        return outcome == Pace.GO

    def _stop_here(self) -> RangeState:
        """A stop was requested (or the stream is paused): commit what was processed, return."""
        self._flush()
        health = self.pacer.health_reason if self.pacer else ""
        why = {
            Pace.PAUSED: "stream paused",
            Pace.THROTTLED: "throttled; yielding",
            Pace.UNHEALTHY: f"unhealthy ({health}); yielding",
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
            return self.source.fetch(self.read, self.hi, self.size)
        except Exception as exc:  # the source is a dependency too
            self._flush()
            self.attempt += 1
            self.source.reset()
            self._backoff(self.attempt, "reading the chunk", exc)
            return None

    def _process(self, rows: Sequence[tuple]) -> Verdict | None:
        """Hand the rows to the processor; None after a dependency failure (backed off)."""
        self.rows_read += len(rows)
        last = encode_key(tuple(rows[-1][: self.arity]))
        if self.pool is not None and last < self.hi:
            self.pending = self.pool.submit(self.source.fetch, last, self.hi, self.size)
        chunk = Chunk(
            self.round_id,
            self.range_id,
            self.source.column_names,
            rows,
            self.key_of,
            self.attempt + 1,
        )
        try:
            started = time.perf_counter()
            result = self.processor(chunk)
            elapsed_ms = (time.perf_counter() - started) * 1000
            self.t.metrics.timing("chunk.process", elapsed_ms, tags=self.t.tags)
            failed, skipped = self._interpret(chunk, result)
            self._check_chunk_outage(failed, len(rows))
        except Exception as exc:
            # RetryableError, or anything unexpected, is a dependency failure: the cursor
            # stays and the chunk is read again. The engine's own errors are not.
            if isinstance(exc, KeysetError) and not isinstance(exc, RetryableError):
                raise
            release(rows)
            self._drop_prefetched()
            self._flush()
            self.attempt += 1
            if isinstance(exc, RetryableError):
                self._backoff(self.attempt, "the processor's dependency", exc)
            else:
                self._backoff(self.attempt, "the processor", exc)
            return None
        self.attempt = 0
        return Verdict(last, failed, skipped)

    def _check_chunk_outage(self, failed: dict[str, str], n_rows: int) -> None:
        ratio = self.o.outage_failure_ratio
        if len(failed) >= 2 and len(failed) > ratio * n_rows:
            raise RetryableError(
                f"{len(failed)} of {n_rows} items failed, more than outage_failure_ratio={ratio}; "
                "treating it as a dependency failure, not as bad items "
                f"(first: {next(iter(failed.values()))})"
            )

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
        """Commit the processed group: the cursor moves to ``read`` with its counters."""
        if self.group.chunks:
            g = self.group
            self._commit(self.read, g.done, g.skipped, failed=sorted(g.failed))
            g.reset()

    def _tick(self, n_rows: int) -> None:
        s, g = self.state, self.group
        with_group = RangeState(s.cursor, s.done + g.done, s.skipped + g.skipped, s.dead, s.retries)
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

    # -- failures and commits ---------------------------------------------------------------------
    def _backoff(self, attempt: int, what: str, exc: BaseException) -> None:
        self.t.metrics.incr("dependency.failure", tags=self.t.tags)
        cursor = display_key(self.state.cursor, self.arity)
        if attempt >= self.o.max_chunk_attempts:
            raise DependencyFailedError(
                f"round {self.round_id} range {self.range_id}: {what} failed {attempt} times in a "
                f"row (last: {type(exc).__name__}: {exc}); the cursor stays at {cursor}, nothing "
                "was skipped. An Airflow retry (or a new traverse) resumes from there."
            ) from exc
        delay = min(self.o.backoff_max, self.o.backoff_base * 2 ** (attempt - 1))
        delay *= random.uniform(0.5, 1.0)
        log.warning(
            "round %s range %d: %s failed (attempt %d/%d): %s: %s; cursor stays at %s, "
            "retrying in %.2f s",
            self.round_id,
            self.range_id,
            what,
            attempt,
            self.o.max_chunk_attempts,
            type(exc).__name__,
            exc,
            cursor,
            delay,
        )
        time.sleep(delay)

    def _commit(
        self,
        new: str,
        done: int,
        skipped: int,
        resolved: Sequence[tuple[str, str]] = (),
        failed: Sequence[tuple[str, str]] = (),
    ) -> None:
        """Advance the cursor from the committed one to ``new`` with the counters (fenced)."""
        metrics, tags = self.t.metrics, self.t.tags
        started = time.perf_counter()
        try:
            a = self.store.advance(
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
            )
        except (LeaseLostError, CursorConflictError):
            metrics.incr("advance.refused", tags=tags)
            raise
        metrics.timing("chunk.commit", (time.perf_counter() - started) * 1000, tags=tags)
        metrics.incr("chunks", tags=tags)
        before = self.state
        for name, delta in (
            ("rows.done", a.done - before.done),
            ("rows.skipped", a.skipped - before.skipped),
            ("rows.dead", a.dead - before.dead),
        ):
            if delta:
                metrics.incr(name, delta, tags=tags)
        self.state = RangeState(a.cursor, a.done, a.skipped, a.dead, a.retries, a.complete)
        self.chunks += 1
        self.checkpoint(force=a.complete)
        if a.dead > before.dead:
            log.error(
                "round %s range %d: %d item(s) dead-lettered after %d attempts (see dead letters)",
                self.round_id,
                self.range_id,
                a.dead - before.dead,
                self.o.max_item_attempts,
            )

    def checkpoint(self, force: bool = False) -> None:
        """Mirror the committed state durably, at most every ``checkpoint_seconds``."""
        mirror = self.t.mirror
        if mirror is None:
            return
        if not force and time.monotonic() - self.last_checkpoint < self.t.checkpoint_seconds:
            return
        self.last_checkpoint = time.monotonic()
        try:
            snapshot = self.store.snapshot_range(self.round_id, self.range_id)
            mirror.save_range(self.t.stream, self.round_id, self.range_id, snapshot)
        except RoundStateLostError:
            raise
        except Exception as exc:  # the mirror is a safety net; its outage must not stop the range
            log.warning(
                "round %s range %d: checkpoint mirror write failed: %s",
                self.round_id,
                self.range_id,
                exc,
            )

    def _interpret(self, chunk: Chunk, result: Any) -> tuple[dict[str, str], list[str]]:
        """-> (failed encoded key -> reason, skipped encoded keys), checked against the chunk."""
        if result is None:
            return {}, []
        if not isinstance(result, ChunkResult):
            raise ProcessorContractError(
                f"processor returned {type(result).__name__}; it must return ChunkResult or None. "
                f"Nothing of round {self.round_id} range {self.range_id} was committed."
            )
        if not result.failed and not result.skipped:
            return {}, []
        index = {_norm(k): encode_key(as_tuple(k, self.arity)) for k in chunk.keys}

        def encoded(k: Any, field_name: str) -> str:
            enc = index.get(_norm(k))
            if enc is None:
                raise ProcessorContractError(
                    f"ChunkResult.{field_name} names key {k!r}, which is not in the chunk"
                )
            return enc

        failed = {encoded(k, "failed"): str(reason) for k, reason in result.failed.items()}
        skipped = {encoded(k, "skipped") for k in result.skipped}
        return failed, sorted(skipped - failed.keys())

    # -- item retry passes ------------------------------------------------------------------------
    def _drain_retries(self, heart: Heartbeat) -> None:
        """Items that failed on their own get further attempts once the cursor reached ``hi``;
        after ``max_item_attempts`` they are dead-lettered. The range completes when none is
        left."""
        attempt, passes = 0, 0
        while self.state.retries > 0 and not self.state.complete:
            self._check_lease(heart, "lease lost during retries")
            entries = self.store.retry_entries(self.round_id, self.range_id, self.o.chunk_size)
            if not entries:
                break
            passes += 1
            first_attempts = min(e[1] for e in entries)
            time.sleep(min(self.o.backoff_max, self.o.item_retry_delay * 2 ** (first_attempts - 1)))
            try:
                rows, failed, skipped = self._retry_pass(entries, passes + 1)
            except RetryableError as exc:
                attempt += 1
                self._backoff(attempt, "the processor's dependency (item retry pass)", exc)
                continue
            except KeysetError:
                raise
            except Exception as exc:
                attempt += 1
                self._backoff(attempt, "an item retry pass", exc)
                continue
            attempt = 0
            resolved = self._resolutions(entries, rows, failed, skipped)
            self._commit(self.state.cursor, 0, 0, resolved=resolved, failed=sorted(failed.items()))
            log.info(
                "round %s range %d: item retry pass %d: %d resolved, %d still failing, "
                "%d dead so far",
                self.round_id,
                self.range_id,
                passes,
                len(resolved),
                len(failed),
                self.state.dead,
            )

    def _retry_pass(
        self, entries: Sequence[tuple[str, int, str]], attempt: int
    ) -> tuple[Sequence[tuple], dict[str, str], list[str]]:
        """Read the failed items again and hand them to the processor as one chunk."""
        rows = self.source.fetch_keys([e[0] for e in entries])
        if not rows:
            return rows, {}, []
        chunk = Chunk(
            self.round_id, self.range_id, self.source.column_names, rows, self.key_of, attempt
        )
        failed, skipped = self._interpret(chunk, self.processor(chunk))
        self._check_pass_outage(entries, failed)
        return rows, failed, skipped

    def _resolutions(
        self,
        entries: Sequence[tuple[str, int, str]],
        rows: Sequence[tuple],
        failed: dict[str, str],
        skipped: list[str],
    ) -> list[tuple[str, str]]:
        """Retried items that reached a terminal state: ``"d"`` done, ``"s"`` skipped. A row that
        is gone (deleted, no longer matches ``where``) reached a terminal state too: skipped."""
        present = {encode_key(tuple(r[: self.arity])) for r in rows}
        skip = set(skipped)
        return [
            (enc, "s" if enc in skip or enc not in present else "d")
            for enc, _, _ in entries
            if enc not in failed
        ]

    def _check_pass_outage(
        self, entries: Sequence[tuple[str, int, str]], failed: dict[str, str]
    ) -> None:
        """A retry pass where (nearly) every item failed, and failed for a reason other than the
        one it failed with before, is a dependency failure: it must not use up the items'
        attempts. Items that are bad on their own keep failing for their own reasons and are still
        dead-lettered. Dead letters being replayed are left out: a replay is an explicit retry,
        its verdicts count."""
        before = {enc: err for enc, _, err in entries if not err.startswith("replay of: ")}
        failed = {enc: why for enc, why in failed.items() if enc in before}
        if len(failed) < 2 or len(failed) <= self.o.outage_failure_ratio * len(before):
            return
        changed = sum(1 for enc, why in failed.items() if _stored(why) != before[enc])
        if changed * 2 > len(failed):
            raise RetryableError(
                f"{len(failed)} of {len(before)} items failed again in a retry pass, {changed} of "
                f"them for a new reason (first: {next(iter(failed.values()))}); treating it as a "
                "dependency failure"
            )


def _norm(k: Any) -> Any:
    return tuple(k) if isinstance(k, list) else k


def _stored(reason: str) -> str:
    """An error reason as the store keeps it."""
    return reason.replace("\n", " ")[:500]


__all__ = ["Heartbeat", "RangeResult", "RangeRun", "RangeState", "run_range"]
