"""The commit side of a range run: the fenced advance of what was processed, with its counters
and metrics; the answer to a split request that the advance carries back (``range_split.py``); the
durable checkpoint mirror; the backoff after a dependency failure.

``RangeRun`` (``range_run.py``) inherits ``RangeCommits``; the attributes declared below are set
by ``RangeRun.__init__``.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..errors import (
    CursorConflictError,
    DependencyFailedError,
    LeaseLostError,
    RoundStateLostError,
)
from ..keys import display_key
from ..options import TraverseOptions
from ..store.cursor_store import Advanced, CursorStore
from .claim import mirror_coalesced
from .state import CommittedRange

if TYPE_CHECKING:
    from ..traversal import KeysetTraversal
    from .split import Splitter
    from .state import Heartbeat

log = logging.getLogger("airflow_keyset_provider")


class RangeCommits:
    """Commits, checkpoints and backoff of one claimed range (mixed into ``RangeRun``)."""

    t: KeysetTraversal
    store: CursorStore
    round_id: str
    range_id: int
    token: str
    o: TraverseOptions
    arity: int
    state: CommittedRange
    chunks: int
    last_checkpoint: float
    splitter: Splitter
    heart: Heartbeat
    released: bool = False  # the completing advance released the lease (nothing left to do)

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
        self.t._stop.wait(delay)  # a stop request ends the wait; the caller then stops

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
            with self.heart.lock:  # no beat in flight while this step may release the range
                a = self._advance(new, done, skipped, resolved, failed)
                if a.released:
                    self.heart.stop()
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
        self.t._progress(self.state, force)  # the caller's on_progress, throttled by itself
        mirror = self.t.mirror
        if mirror is None:
            return
        if not force and time.monotonic() - self.last_checkpoint < self.t.checkpoint_seconds:
            return
        self.last_checkpoint = time.monotonic()
        try:
            snapshot = self.store.snapshot_range(self.round_id, self.range_id)
            if snapshot.get("unmirrored"):  # the mirror missed this range's coalescing
                mirror_coalesced(self.t, self.round_id, self.range_id, int(snapshot["unmirrored"]))
                return
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


__all__ = ["RangeCommits"]
