"""Pause, resume and throttle a stream, and the pacer every traversal consults between chunks.

The stream's control hash ``P:{S}:control`` (``CursorStore.control_key``) holds what an operator
decided for the stream as a whole::

    paused               "1" while the stream is paused (absent otherwise)
    reason, paused_by    why, and who said so (free text)
    paused_at            when, in ms on the Redis server's clock
    resumed_at           the last resume, in ms
    max_rows_per_second  the throughput budget shared by every task (absent: none)

``StreamSwitch`` writes it (small Lua scripts, times from ``TIME``) and reads it. ``Pacer`` is what
a running range sees: a light poller thread reads the hash every ``poll_seconds`` (one ``HGETALL``
per second per task, never per chunk), so the loop's check before each chunk is a local flag.

Guarantees:

- Pausing never loses or skips a key: a paused traversal commits the chunk in hand (the cursor
  moves only over processed rows, as always), releases its lease and returns; resuming continues
  from the committed cursors. A running range notices a pause within ``poll_seconds`` plus the
  chunk in hand.
- The governor (``core/pace/governor.py``) is charged only while a rate is set; without one the pacer adds
  no Redis round trip to a chunk.
- Waiting for the budget (or for health) is interruptible: a pause or a stop request ends the wait
  within one poll.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import redis

from .governor import Governor, burst_for
from .health import HealthGate

if TYPE_CHECKING:
    import sqlalchemy as sa

    from ..options import TraverseOptions
    from ..store.cursor_store import CursorStore


log = logging.getLogger("airflow_keyset_provider")

_NOW = "local t = redis.call('TIME'); local now = t[1] * 1000 + math.floor(t[2] / 1000)\n"

PAUSE = (
    """
-- Pause the stream.
-- KEYS[1] control hash  ARGV[1] reason  ARGV[2] who
-- Returns the pause time in ms (the first pause's, if the stream was already paused).
"""
    + _NOW
    + """
local at = redis.call('HGET', KEYS[1], 'paused_at')
if redis.call('HGET', KEYS[1], 'paused') == '1' and at then
  redis.call('HSET', KEYS[1], 'reason', ARGV[1], 'paused_by', ARGV[2])
  return tonumber(at)
end
redis.call('HSET', KEYS[1], 'paused', '1', 'reason', ARGV[1], 'paused_by', ARGV[2],
           'paused_at', now)
return now
"""
)

RESUME = (
    """
-- Resume the stream.
-- KEYS[1] control hash
-- Returns 1 if the stream was paused, 0 if it was not (nothing changed then).
"""
    + _NOW
    + """
if redis.call('HGET', KEYS[1], 'paused') ~= '1' then return 0 end
redis.call('HDEL', KEYS[1], 'paused', 'reason', 'paused_by', 'paused_at')
redis.call('HSET', KEYS[1], 'resumed_at', now)
return 1
"""
)


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


@dataclass(frozen=True)
class ControlState:
    """What the control hash says about the stream (all tasks of it)."""

    paused: bool = False
    reason: str = ""
    paused_by: str = ""
    paused_at_ms: int | None = None
    resumed_at_ms: int | None = None
    max_rows_per_second: float | None = None
    healthy: bool | None = None  # the shared health verdict (None: no health checks ran)
    health_reason: str = ""
    health_checked_at_ms: int | None = None

    @classmethod
    def from_hash(cls, raw: dict[Any, Any], health: dict[Any, Any] | None = None) -> ControlState:
        h = {_s(k): _s(v) for k, v in raw.items()}
        v = {_s(k): _s(x) for k, x in (health or {}).items()}
        rate = h.get("max_rows_per_second")
        return cls(
            healthy=None if "healthy" not in v else v["healthy"] == "1",
            health_reason=v.get("reason", ""),
            health_checked_at_ms=int(v["checked_at"]) if v.get("checked_at") else None,
            paused=h.get("paused") == "1",
            reason=h.get("reason", ""),
            paused_by=h.get("paused_by", ""),
            paused_at_ms=int(h["paused_at"]) if h.get("paused_at") else None,
            resumed_at_ms=int(h["resumed_at"]) if h.get("resumed_at") else None,
            max_rows_per_second=float(rate) if rate else None,
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "paused": self.paused,
            "reason": self.reason or None,
            "paused_by": self.paused_by or None,
            "paused_at_ms": self.paused_at_ms,
            "resumed_at_ms": self.resumed_at_ms,
            "max_rows_per_second": self.max_rows_per_second,
            "healthy": self.healthy,
            "health_reason": self.health_reason or None,
            "health_checked_at_ms": self.health_checked_at_ms,
        }


class StreamSwitch:
    """Writes and reads one stream's control hash (pause, resume, throttle)."""

    def __init__(self, store: CursorStore) -> None:
        self.store = store
        self.key = store.control_key
        self._pause = store.script(PAUSE)
        self._resume = store.script(RESUME)

    def state(self) -> ControlState:
        """The stream's control state and health verdict (one pipelined read)."""
        control, health = self.store.control_hashes()
        return ControlState.from_hash(control, health)

    def pause(self, reason: str = "", by: str = "") -> ControlState:
        """Pause every task of the stream: each commits the chunk in hand, releases its lease and
        returns (``RangeResult.paused``; in Airflow the task defers) until ``resume``."""
        self._pause(keys=[self.key], args=[reason, by])
        log.warning("stream %s: paused (%s)", self.store.stream, reason or "no reason given")
        return self.state()

    def resume(self) -> bool:
        """Lift a pause; True if the stream was paused. Tasks continue from their cursors."""
        was = bool(self._resume(keys=[self.key], args=[]))
        if was:
            log.warning("stream %s: resumed", self.store.stream)
        return was

    def throttle(self, max_rows_per_second: float | None) -> ControlState:
        """Set (or, with None, lift) the stream's shared rows-per-second budget. Running tasks
        pick it up within one poll."""
        if max_rows_per_second is None:
            self.store.set_control_field("max_rows_per_second", None)
        else:
            rate = float(max_rows_per_second)
            if not rate > 0:
                from ..errors import ConfigurationError

                raise ConfigurationError(
                    f"max_rows_per_second must be a positive number, got {max_rows_per_second!r}"
                )
            self.store.set_control_field("max_rows_per_second", repr(rate))
        return self.state()


class ControlWatch(threading.Thread):
    """Reads the control hash every ``poll_seconds`` so the loop reads a local value. A failed
    read keeps the last state (logged); the fence, not this thread, protects the cursor."""

    def __init__(self, switch: StreamSwitch, poll_seconds: float = 1.0) -> None:
        super().__init__(name=f"keyset-control-{switch.store.stream}", daemon=True)
        self.switch, self.poll_seconds = switch, poll_seconds
        self.state = ControlState()
        self.paused = threading.Event()
        self.changed = threading.Event()  # set at every read that changed the state
        self._halt = threading.Event()

    def refresh(self) -> ControlState:
        try:
            state = self.switch.state()
        except redis.RedisError as exc:
            log.warning("stream %s: control state unreadable: %s", self.switch.store.stream, exc)
            return self.state
        if state != self.state:
            self.state = state
            self.changed.set()
        if state.paused:
            self.paused.set()
        else:
            self.paused.clear()
        return state

    def run(self) -> None:
        while not self._halt.wait(self.poll_seconds):
            self.refresh()

    def stop(self) -> None:
        self._halt.set()


class Pace:
    """What the pacer tells the loop before a chunk."""

    GO = ""
    PAUSED = "paused"  #: the stream is paused: commit, release, return
    THROTTLED = "throttled"  #: over budget for longer than the caller waits in place
    UNHEALTHY = "unhealthy"  #: the health verdict stayed bad longer than the caller waits in place
    STOPPED = "stopped"  #: a stop was requested while waiting


class Pacer:
    """The one step a range run takes before each chunk read (``RangeRun._pace``).

    ``gate(rows)`` charges the rows read since the previous call to the stream's budget (only when
    a rate is set) and waits out the budget, interruptibly; it returns ``Pace.GO`` to go on, or a
    reason to commit and return. ``yield_after`` (seconds, None: wait in place however long) is
    how long one wait may be before the pacer returns ``Pace.THROTTLED`` instead, so an
    orchestrator can free the worker slot (Airflow defers) and come back after ``retry_after``.
    """

    def __init__(
        self,
        store: CursorStore,
        *,
        poll_seconds: float = 1.0,
        yield_after: float | None = None,
        chunk_rows: int = 1000,
        stop: threading.Event | None = None,
        health: HealthGate | None = None,
    ) -> None:
        self.stream = store.stream
        self.health = health
        self.health_reason: str | None = None  # the last unhealthy verdict seen
        self.switch = StreamSwitch(store)
        self.watch = ControlWatch(self.switch, poll_seconds)
        self.governor = Governor(store)
        self.yield_after, self.chunk_rows = yield_after, chunk_rows
        self.stop_event = stop or threading.Event()
        self.retry_after = 0.0  # with Pace.THROTTLED: seconds until the budget allows a chunk
        self.throttled_seconds = 0.0  # total time waited for the budget
        self._last_log = 0.0

    def start(self) -> None:
        self.watch.refresh()  # a stream paused before the run starts stops before its first chunk
        self.watch.start()

    def stop(self) -> None:
        self.watch.stop()

    @property
    def state(self) -> ControlState:
        return self.watch.state

    def gate(self, rows: int) -> str:
        """Before a chunk: ``Pace.GO`` or why to stop here (see the class docstring)."""
        if self.watch.paused.is_set():
            return Pace.PAUSED
        if self.health is not None:
            outcome = self._wait_healthy()
            if outcome:
                return outcome
        rate = self.watch.state.max_rows_per_second
        if rate is None or rows <= 0:
            return Pace.GO
        wait = self.governor.charge(rows, rate, burst_for(rate, self.chunk_rows))
        if wait <= 0:
            return Pace.GO
        if self.yield_after is not None and wait > self.yield_after:
            self.retry_after = wait
            log.info(
                "stream %s: over its budget of %.0f rows/s for %.1f s more; yielding the worker",
                self.stream,
                rate,
                wait,
            )
            return Pace.THROTTLED
        self._log_wait(rate, wait)
        return self._wait(wait)

    def _wait_healthy(self) -> str:
        """Until the shared verdict is healthy (re-read every ``min(poll, 1)`` s)."""
        assert self.health is not None
        reason = self.health.check()
        if self.stop_event.is_set():
            return Pace.STOPPED  # a stop request ended the wait for a probe
        started = time.monotonic()
        while reason is not None:
            self.health_reason = reason
            if self.yield_after is not None and time.monotonic() - started >= self.yield_after:
                self.retry_after = self.health.poll_seconds
                return Pace.UNHEALTHY
            outcome = self._wait(min(self.health.poll_seconds, 1.0))
            if outcome:
                return outcome
            reason = self.health.check()
            if self.stop_event.is_set():
                return Pace.STOPPED
        return Pace.GO

    def _log_wait(self, rate: float, wait: float) -> None:
        now = time.monotonic()
        if now - self._last_log >= 30.0:
            self._last_log = now
            log.info(
                "stream %s: throttled to %.0f rows/s (shared by every task); waiting %.2f s "
                "(waited %.1f s so far)",
                self.stream,
                rate,
                wait,
                self.throttled_seconds,
            )

    def _wait(self, seconds: float) -> str:
        """Sleep ``seconds``, waking up for a pause or a stop request (checked every 0.2 s)."""
        end = time.monotonic() + seconds
        started = time.monotonic()
        try:
            while (left := end - time.monotonic()) > 0:
                if self.stop_event.wait(min(left, 0.2)):
                    return Pace.STOPPED
                if self.watch.paused.is_set():
                    return Pace.PAUSED
            return Pace.GO
        finally:
            self.throttled_seconds += time.monotonic() - started


def make_pacer(
    store: CursorStore, engine: sa.Engine, stop: threading.Event, o: TraverseOptions
) -> Pacer:
    """A range's (or a pull call's) pacer: the stream's pause, rows/s budget and (with
    ``health_checks``) health gate, polled every ``control_poll_seconds``; a probe is bounded by
    ``probe_timeout`` and ended by ``stop``."""
    return Pacer(
        store,
        poll_seconds=o.control_poll_seconds,
        yield_after=o.yield_after_seconds,
        chunk_rows=o.chunk_size,
        stop=stop,
        health=(
            HealthGate(
                store,
                o.health_checks,
                engine,
                o.health_poll_seconds,
                timeout=probe_timeout(o),
                stop=stop,
            )
            if o.health_checks
            else None
        ),
    )


def probe_timeout(o: TraverseOptions) -> float:
    """The bound of one health probe, or one checkpoint mirror statement, of a traversal: the
    smaller of its ``chunk_timeout`` (when set) and its lease, so neither holds the range longer
    than a processor call may, nor past one lease."""
    bounds = [o.lease_seconds] + ([o.chunk_timeout] if o.chunk_timeout else [])
    return float(min(bounds))


__all__ = [
    "ControlState",
    "ControlWatch",
    "Pace",
    "Pacer",
    "StreamSwitch",
    "make_pacer",
    "probe_timeout",
]
