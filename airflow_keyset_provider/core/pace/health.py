"""Health throttling: checks of the source database, probed once for every task of a stream.

A check answers "may the stream take another chunk now?". Built-ins:

- ``ReplicationLag(max_seconds)``: the largest ``replay_lag`` of the source's replicas
  (``pg_stat_replication`` on the primary; no replica: 0);
- ``ActiveBackends(max_active)``: ``pg_stat_activity`` backends in state ``active`` on the
  source's database (this traversal's own probe included);
- ``SqlThreshold(sql, max_value)``: any SQL returning one number, healthy while it is at most
  ``max_value``;
- ``CallableCheck(fn)``: a Python callable returning ``True``/``False`` or ``(ok, reason)``.

Sharing: the verdict lives in Redis (``<control key>:health``, ``CursorStore.health_key``, a
hash: ``healthy``, ``reason``, ``checked_at`` on the Redis server's clock). Before each chunk a
task reads it with one small script; when it is older than ``poll_seconds`` the script also hands
that task a short lock (``<control key>:health_lock``, ``health_lock_key``, ``SET NX PX``), and
only that task runs the probes and stores the new verdict. So one probe per poll serves every task of the stream, however many there are.

Guarantees: while the stored verdict is unhealthy, no task of the stream starts a chunk (each
stops before its next one, committing the chunk in hand first); a task waiting for health
re-reads the verdict every ``min(poll_seconds, 1)`` s, so it starts again within one poll of
recovery. A probe that fails (SQL error, timeout, the callable raising) counts as unhealthy, with
the error as the reason: an outage of the source never reads as "healthy, go faster". The health
read costs one Redis round trip per chunk, and only when checks are configured.

A probe is bounded (``tests/core/pace/test_health_timeouts.py``): with ``timeout`` (a traversal gives
the smaller of its ``chunk_timeout`` and its lease) every SQL statement of the built-in checks
runs with a statement and a lock timeout (``core/pace/sql_timeouts.py``), and the task waits for
the probes at most ``timeout`` plus one second (a callable that hangs included) before counting
the probe as unhealthy (``health probe timed out``); a stop request ends that wait at once. So a
probe blocked on a lock never holds the range's loop, and with it its lease, past that bound.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import sqlalchemy as sa

from .sql_timeouts import bounded_connection

if TYPE_CHECKING:
    from ..store.cursor_store import CursorStore


log = logging.getLogger("airflow_keyset_provider")

READ_VERDICT = """
-- Read the stream's shared health verdict; hand out the probe lock when it is stale.
-- KEYS[1] health hash  KEYS[2] probe lock
-- ARGV[1] poll ms (a verdict older than this is stale)  ARGV[2] lock ms  ARGV[3] caller token
-- Returns {healthy ('1'/'0'/''), reason, age ms (-1: none yet), probe ('1': the caller probes)}.
local t = redis.call('TIME'); local now = t[1] * 1000 + math.floor(t[2] / 1000)
local h = redis.call('HMGET', KEYS[1], 'healthy', 'reason', 'checked_at')
local age = -1
if h[3] then age = now - tonumber(h[3]) end
local probe = '0'
if age < 0 or age >= tonumber(ARGV[1]) then
  if redis.call('SET', KEYS[2], ARGV[3], 'NX', 'PX', tonumber(ARGV[2])) then probe = '1' end
end
return {h[1] or '', h[2] or '', age, probe}
"""

WRITE_VERDICT = """
-- Store a probe's verdict and release the probe lock if the caller still holds it.
-- KEYS[1] health hash  KEYS[2] probe lock
-- ARGV[1] healthy ('1'/'0')  ARGV[2] reason  ARGV[3] caller token  ARGV[4] ttl ms of the verdict
-- Returns the check time in ms (Redis TIME).
local t = redis.call('TIME'); local now = t[1] * 1000 + math.floor(t[2] / 1000)
redis.call('HSET', KEYS[1], 'healthy', ARGV[1], 'reason', ARGV[2], 'checked_at', now)
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[4]))
if redis.call('GET', KEYS[2]) == ARGV[3] then redis.call('DEL', KEYS[2]) end
return now
"""


@dataclass(frozen=True)
class Verdict:
    """One probe's answer: ``ok`` or not, and why (shown in logs, the CLI and the UI)."""

    ok: bool
    reason: str = ""


class HealthCheck(Protocol):
    """A check of the source: ``probe(engine)`` -> ``Verdict``. ``name`` labels it in reasons."""

    name: str

    def probe(self, engine: sa.Engine) -> Verdict: ...


PROBE_GRACE_SECONDS = 1.0  # past the statement timeout, before the wait for a probe gives up


def _scalar(engine: sa.Engine, sql: str, timeout: float | None = None) -> float:
    """The number ``sql`` returns; with ``timeout``, its statement and lock waits are bounded."""
    if timeout is None:
        with engine.connect() as conn:
            value = conn.execute(sa.text(sql)).scalar()
    else:
        with bounded_connection(engine, timeout) as conn:
            value = conn.execute(sa.text(sql)).scalar()
    return float(value or 0)


@dataclass(frozen=True)
class SqlThreshold:
    """Healthy while ``sql`` (one row, one number) returns at most ``max_value``."""

    sql: str
    max_value: float
    name: str = "sql"
    unit: str = ""

    def probe(self, engine: sa.Engine, timeout: float | None = None) -> Verdict:
        """``timeout``: seconds the statement (and each lock wait) may take; None: no limit."""
        value = _scalar(engine, self.sql, timeout)
        if value <= self.max_value:
            return Verdict(True, f"{self.name} {value:g}{self.unit} <= {self.max_value:g}")
        return Verdict(False, f"{self.name} {value:g}{self.unit} > {self.max_value:g}{self.unit}")


def ReplicationLag(max_seconds: float) -> SqlThreshold:
    """PostgreSQL: the largest ``replay_lag`` of the source's replicas, in seconds."""
    return SqlThreshold(
        "SELECT coalesce(max(extract(epoch FROM replay_lag)), 0) FROM pg_stat_replication",
        max_seconds,
        "replication lag",
        " s",
    )


def ActiveBackends(max_active: int) -> SqlThreshold:
    """PostgreSQL: client backends in state ``active`` on the source's database."""
    return SqlThreshold(
        "SELECT count(*) FROM pg_stat_activity WHERE state = 'active' "
        "AND backend_type = 'client backend' AND datname = current_database()",
        max_active,
        "active backends",
    )


@dataclass(frozen=True)
class CallableCheck:
    """A Python callable ``fn() -> bool | (bool, reason)``."""

    fn: Callable[[], Any]
    name: str = "callable"

    def probe(self, engine: sa.Engine) -> Verdict:
        out = self.fn()
        if isinstance(out, tuple):
            ok, reason = bool(out[0]), str(out[1])
        else:
            ok, reason = bool(out), ""
        return Verdict(ok, f"{self.name}: {reason}" if reason else self.name)


class HealthGate:
    """Reads (and, when it is stale and this task holds the lock, refreshes) the stream's shared
    verdict. ``check()`` -> None when healthy, else the reason. ``timeout`` bounds a probe and
    ``stop`` ends the wait for one (module docstring); ``check`` then returns None without
    storing a verdict, and the caller sees ``stop`` set."""

    def __init__(
        self,
        store: CursorStore,
        checks: Sequence[HealthCheck],
        engine: sa.Engine,
        poll_seconds: float = 5.0,
        *,
        timeout: float | None = None,
        stop: threading.Event | None = None,
    ) -> None:
        self.checks, self.engine, self.poll_seconds = tuple(checks), engine, poll_seconds
        self.timeout = timeout
        self.stop = stop or threading.Event()
        self.stream = store.stream
        self.keys = [store.health_key, store.health_lock_key]
        self.token = uuid.uuid4().hex
        self._read = store.script(READ_VERDICT)
        self._write = store.script(WRITE_VERDICT)
        self._last_reason: str | None = None

    def check(self) -> str | None:
        poll_ms = int(self.poll_seconds * 1000)
        lock_ms = max(poll_ms, 5000)
        healthy, reason, _age, probe = self._read(
            keys=self.keys, args=[poll_ms, lock_ms, self.token]
        )
        healthy, reason = _s(healthy), _s(reason)
        if _s(probe) == "1":
            verdict = self._bounded_probe()
            if verdict is None:
                return None  # stopped while the probe ran: no verdict (the lock expires)
            healthy, reason = ("1" if verdict.ok else "0"), verdict.reason
            self._write(
                keys=self.keys,
                args=[healthy, reason, self.token, max(10 * poll_ms, 60_000)],
            )
        bad = reason if healthy == "0" else None
        if bad != self._last_reason:
            if bad is not None:
                log.warning("stream %s: unhealthy (%s); not taking chunks", self.stream, bad)
            elif self._last_reason is not None:
                log.warning("stream %s: healthy again (%s); taking chunks", self.stream, reason)
            self._last_reason = bad
        return bad

    def _bounded_probe(self) -> Verdict | None:
        """``probe`` in a thread of its own, waited for at most ``timeout`` plus a grace (then
        unhealthy: the probe is left to end on its own statement timeout), or until ``stop``
        (None). Without ``timeout`` the probe runs in this thread, unbounded."""
        if self.timeout is None:
            return self.probe()
        box: list[Verdict] = []
        done = threading.Event()

        def run() -> None:
            try:
                box.append(self.probe())
            finally:
                done.set()

        threading.Thread(target=run, name=f"keyset-health-{self.stream}", daemon=True).start()
        deadline = time.monotonic() + self.timeout + PROBE_GRACE_SECONDS
        while not done.wait(min(0.2, max(deadline - time.monotonic(), 0.0))):
            if self.stop.is_set():
                return None
            if time.monotonic() >= deadline:
                return Verdict(False, f"health probe timed out after {self.timeout:g} s")
        return box[0] if box else Verdict(False, "health probe failed")

    def probe(self) -> Verdict:
        """Every check in turn; the first unhealthy (or failing) one decides. The built-in SQL
        checks get ``timeout`` as their statement and lock timeout."""
        reasons = []
        for c in self.checks:
            try:
                if isinstance(c, SqlThreshold):
                    v = c.probe(self.engine, self.timeout)
                else:
                    v = c.probe(self.engine)
            except Exception as exc:  # a failed probe is not a healthy database
                return Verdict(False, f"{getattr(c, 'name', c)}: probe failed: {exc}"[:300])
            if not v.ok:
                return v
            reasons.append(v.reason)
        return Verdict(True, "; ".join(reasons))


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


__all__ = [
    "ActiveBackends",
    "CallableCheck",
    "HealthCheck",
    "HealthGate",
    "ReplicationLag",
    "SqlThreshold",
    "Verdict",
]
