"""The pieces a range run is made of: its result, its heartbeat, its committed state, the group
of processed chunks not yet committed, and its progress log lines.

``RangeRun`` (``core/run/range_run.py``) owns the loop; these hold no policy of their own.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import redis

from ..errors import KeysetError
from ..keys import display_key
from ..store.cursor_store import CursorStore

log = logging.getLogger("airflow_keyset_provider")


@dataclass(frozen=True)
class RangeResult:
    """Counters of one range (cumulative over every attempt) after a ``traverse`` call."""

    round_id: str
    range_id: int
    done: int
    skipped: int
    dead: int
    complete: bool
    cursor: str
    rows_read: int = 0  # rows read by this call (including replays)
    chunks: int = 0  # chunks committed by this call
    stopped: bool = False  # a stop was requested and honoured
    takeover: bool = False
    seconds: float = 0.0
    paused: bool = False  # the stream is paused: committed, released, returned (resume continues)
    yielded: str = ""  # why the pacer ended the call early: "paused", "throttled", "unhealthy"
    retry_after: float = 0.0  # "throttled"/"unhealthy": seconds worth waiting before trying again
    coalesced: int = 0  # fresh ranges this call's claim absorbed into this one (pull mode)

    def as_dict(self) -> dict[str, Any]:
        return {
            "round_id": self.round_id,
            "range_id": self.range_id,
            "done": self.done,
            "skipped": self.skipped,
            "dead": self.dead,
            "complete": self.complete,
            "rows_read": self.rows_read,
            "chunks": self.chunks,
            "seconds": round(self.seconds, 3),
            "paused": self.paused,
            "yielded": self.yielded or None,
        }


class Heartbeat:
    """Renews the lease of one claimed range every third of it, while the range makes progress.

    If the store says the token no longer owns the range, ``lost`` is set and the loop stops
    before its next side effect. The lease follows progress, not the process: while a processor
    call runs (``busy``/``idle``), a call older than ``chunk_timeout`` stops the renewals and sets
    ``overrun``. Timeline: try A's processor hangs at t0; A beats until t0 + chunk_timeout, then
    stops; its lease lapses ``lease`` seconds later and try B claims the range (new token, new
    epoch). If A's call ever returns, A sees ``overrun`` and fails with ``LeaseLostError``; even a
    late advance of A would be refused by the store (fencing), so B's cursor is safe.

    The beats come from a ``HeartbeatThread``: ``start`` gives this range a thread of its own;
    a pull loop instead ``attach``es each of its ranges in turn to one thread it keeps (the first
    beat of a range then comes at most a third of the lease after the attach, never later)."""

    def __init__(
        self,
        store: CursorStore,
        round_id: str,
        range_id: int,
        token: str,
        lease_ms: int,
        chunk_timeout: float = math.inf,
    ) -> None:
        self.store, self.round_id, self.range_id = store, round_id, range_id
        self.token, self.lease_ms, self.chunk_timeout = token, lease_ms, chunk_timeout
        self.lost = threading.Event()
        self.overrun = threading.Event()  # a processor call ran past chunk_timeout: beats stopped
        self._busy_since: float | None = None
        self._halt = threading.Event()  # no more beats for this range
        # held around each beat and, by the owner, around each advance: a beat never races the
        # advance that completes and releases the range (``stop`` under it ends the beats)
        self.lock = threading.Lock()
        self._thread: HeartbeatThread | None = None  # its own thread (``start``), if any

    def busy(self) -> None:
        """A processor call starts now."""
        self._busy_since = time.monotonic()

    def idle(self) -> None:
        """The processor call returned (or raised)."""
        self._busy_since = None

    def start(self) -> None:
        """Beat from a thread of this range's own (stopped by ``stop``)."""
        self._thread = HeartbeatThread(self.lease_ms, f"{self.round_id}-{self.range_id}")
        self._thread.attach(self)
        self._thread.start()

    def stop(self) -> None:
        """No more beats for this range (its own thread, if any, ends)."""
        self._halt.set()
        if self._thread is not None:
            self._thread.stop()

    @property
    def halted(self) -> bool:
        return self._halt.is_set()

    def beat(self) -> bool:
        """Renew the lease once; False: stop beating this range (lost or overrun)."""
        if self._stalled():
            return False
        with self.lock:
            if self._halt.is_set():
                return False  # released by its completing advance: nothing to renew
            return self._renew()

    def _renew(self) -> bool:
        try:
            if self.store.heartbeat(self.round_id, self.range_id, self.token, self.lease_ms):
                return True
        except (KeysetError, redis.RedisError) as exc:  # keep trying; the fence protects the cursor
            log.warning(
                "round %s range %d: heartbeat failed: %s", self.round_id, self.range_id, exc
            )
            return True
        log.error(
            "round %s range %d: lease lost (another worker owns the range); stopping",
            self.round_id,
            self.range_id,
        )
        self.lost.set()
        return False

    def _stalled(self) -> bool:
        """True (and ``overrun`` set) once the call in progress is older than chunk_timeout."""
        since = self._busy_since
        if since is None or time.monotonic() - since <= self.chunk_timeout:
            return False
        log.error(
            "round %s range %d: a processor call has run %.1f s, past chunk_timeout=%g s; "
            "heartbeats stop so the lease lapses and another try can take the range over",
            self.round_id,
            self.range_id,
            time.monotonic() - since,
            self.chunk_timeout,
        )
        self.overrun.set()
        return True


class HeartbeatThread(threading.Thread):
    """Beats the attached range's ``Heartbeat`` every third of ``lease_ms`` until ``stop``; a
    pull loop keeps one across its ranges instead of starting a thread per range."""

    def __init__(self, lease_ms: int, name: str = "") -> None:
        super().__init__(name=f"keyset-heartbeat-{name}", daemon=True)
        self.lease_ms = lease_ms
        self.current: Heartbeat | None = None
        self._halt = threading.Event()

    def attach(self, heart: Heartbeat | None) -> None:
        """Beat ``heart`` from now on (None: nothing)."""
        self.current = heart

    def run(self) -> None:
        while not self._halt.wait(self.lease_ms / 3000):
            heart = self.current
            if heart is None or heart.halted:
                continue
            if not heart.beat():
                heart._halt.set()  # lost or overrun: this range gets no more beats

    def stop(self) -> None:
        self._halt.set()


@dataclass
class CommittedRange:
    """The range as last committed (cursor and cumulative counters)."""

    cursor: str
    done: int
    skipped: int
    dead: int
    retries: int
    complete: bool = False
    stopped: bool = False


@dataclass
class Group:
    """Outcomes of processed chunks not yet committed (group commit)."""

    chunks: int = 0
    done: int = 0
    skipped: int = 0
    failed: list[tuple[str, str]] = field(default_factory=list)
    since: float = field(default_factory=time.monotonic)

    def add(self, done: int, skipped: int, failed: Iterable[tuple[str, str]]) -> None:
        if not self.chunks:
            self.since = time.monotonic()
        self.chunks += 1
        self.done += done
        self.skipped += skipped
        self.failed.extend(failed)

    def reset(self) -> None:
        self.chunks = self.done = self.skipped = 0
        self.failed = []


@dataclass
class ProgressLog:
    """Throttled progress lines: what a person needs at 3 a.m. The row estimate behind the ETA is
    read (``estimate_fn``: rows read so far + the source's estimate of the rows left) before the
    first line that shows one, never for a range that ends before its first line."""

    round_id: str
    range_id: int
    hi_label: str
    arity: int
    every_seconds: float
    estimate: int | None
    estimate_fn: Callable[[], int | None] | None = None
    started: float = field(default_factory=time.monotonic)
    last: float = field(default_factory=time.monotonic)
    rows: int = 0

    def tick(self, n: int, cursor: str, state: CommittedRange, force: bool = False) -> None:
        self.rows += n
        now = time.monotonic()
        if not force and now - self.last < self.every_seconds:
            return
        self.last = now
        if self.estimate is None and self.estimate_fn is not None and not force:
            self.estimate, self.estimate_fn = self.estimate_fn(), None
        elapsed = max(now - self.started, 1e-9)
        rate = self.rows / elapsed
        log.info(
            "round %s range %d: cursor %s of %s; done %d, skipped %d, dead %d, retry %d; "
            "%d rows in %.1f s (%.0f rows/s%s)",
            self.round_id,
            self.range_id,
            display_key(cursor, self.arity),
            self.hi_label,
            state.done,
            state.skipped,
            state.dead,
            state.retries,
            self.rows,
            elapsed,
            rate,
            self._eta(rate, force),
        )

    def _eta(self, rate: float, force: bool) -> str:
        if self.estimate and rate > 0 and self.rows < self.estimate:
            return f", ETA {dt.timedelta(seconds=int((self.estimate - self.rows) / rate))}"
        if self.estimate is not None and self.rows >= self.estimate and not force:
            return ", ETA unknown (more rows than the planner estimated; ANALYZE the table)"
        return ""


class Verdict(NamedTuple):
    """A processed chunk: its last key and the processor's verdict (encoded keys)."""

    last: str
    failed: dict[str, str]
    skipped: list[str]


#: ``KeysetTraversal.traverse(on_progress=...)``: called with a copy of the range's committed state.
ProgressCallback = Callable[[CommittedRange], None]


class ProgressHook:
    """Hands the committed state of a range to a plain callable, at most every ``every_seconds``
    (always on a forced call: the range completed or stopped); a state equal to the last one
    reported is not reported again.

    The state handed over was committed in Redis before the call (the callable is an observer,
    never an authority). A failing callable is logged and ignored: reporting progress must not
    stop a range.
    """

    def __init__(self, fn: ProgressCallback | None = None, every_seconds: float = 5.0) -> None:
        self.fn, self.every_seconds = fn, every_seconds
        self.last = float("-inf")
        self.last_state: CommittedRange | None = None

    def __call__(self, state: CommittedRange, force: bool = False) -> None:
        if self.fn is None or state == self.last_state:  # nothing new since the last report
            return
        now = time.monotonic()
        if not force and now - self.last < self.every_seconds:
            return
        self.last, self.last_state = now, dataclasses.replace(state)
        try:
            self.fn(dataclasses.replace(state))
        except Exception as exc:
            log.warning("progress callback failed (ignored; the cursor is in Redis): %s", exc)
