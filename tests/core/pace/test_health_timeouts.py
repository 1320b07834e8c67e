"""A health probe or a checkpoint mirror statement that waits on a lock is bounded (issue #18,
item 8): it ends within the traversal's ``chunk_timeout``/lease as unhealthy (a failed mirror write
is logged and the range goes on), a stop request ends the wait for it, and the range's lease is
not held past its time by it. Real PostgreSQL and Redis; the locks are real row locks held by
another connection. No timing assertions: each wait has a generous bound, and each test fails on
the old code because the wait never ends while the lock is held."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import sqlalchemy as sa
from core_support import make_events, traversal

from airflow_keyset_provider.core import TraverseOptions
from airflow_keyset_provider.core.pace.health import SqlThreshold
from airflow_keyset_provider.core.rounds.mirror import CheckpointMirror

BOUND = 60.0  # seconds any wait below may take on a loaded machine; the old code never ends


def _until(what: Callable[[], Any], message: str) -> Any:
    deadline = time.monotonic() + BOUND
    while not (value := what()):
        assert time.monotonic() < deadline, message
        time.sleep(0.05)
    return value


class RowLock:
    """Another session holding a row lock (``SELECT ... FOR UPDATE`` in an open transaction)."""

    def __init__(self, engine: sa.Engine, sql: str) -> None:
        self.conn = engine.connect()
        self.tx = self.conn.begin()
        self.conn.execute(sa.text(sql))

    def release(self) -> None:
        if self.tx.is_active:
            self.tx.rollback()
        self.conn.close()


def test_a_probe_blocked_on_a_row_lock_ends_unhealthy_and_a_stop_ends_the_traversal(
    pg_engine, pg_schema_url, redis_url, key_prefix
):
    """Scenario: a ``SqlThreshold`` whose query (``SELECT ... FOR UPDATE``) waits on a row lock
    another connection holds; ``lease_seconds=2, chunk_timeout=3``. The probe ends as unhealthy
    (statement bounded by 2 s: the shared verdict says so) and no chunk is processed (nothing
    skipped: the cursor stays); a stop request ends the traversal (bounded wait); another owner
    then takes the range over while the lock is still held, and finishes it once the lock goes.
    Old code: the probe waited for ever, the stop request did nothing, the heartbeat thread kept
    the lease (``LeaseHeldError`` for any other owner)."""
    make_events(pg_engine, list(range(1, 501)))
    with pg_engine.begin() as c:
        c.execute(sa.text("CREATE TABLE probe_lag (id int PRIMARY KEY, seconds int NOT NULL)"))
        c.execute(sa.text("INSERT INTO probe_lag VALUES (1, 0)"))
    check = SqlThreshold("SELECT seconds FROM probe_lag WHERE id = 1 FOR UPDATE", 10, "lag")
    opts = TraverseOptions(
        chunk_size=100,
        lease_seconds=2,
        chunk_timeout=3,
        health_checks=(check,),
        health_poll_seconds=0.5,
        prefetch=False,
        claim_timeout=BOUND,
    )
    t = traversal(pg_schema_url, redis_url, key_prefix)
    rnd = t.plan(max_ranges=1, new_stream=True)
    seen: Counter[int] = Counter()
    lock = RowLock(pg_engine, "SELECT * FROM probe_lag WHERE id = 1 FOR UPDATE")
    first = traversal(pg_schema_url, redis_url, key_prefix)
    out: dict[str, Any] = {}

    def run(name: str, w: Any, lineage: str) -> None:
        try:
            out[name] = w.traverse(
                rnd.round_id,
                0,
                lambda chunk: seen.update(chunk.keys),
                options=dataclasses.replace(opts, owner_lineage=lineage),
            )
        except BaseException as exc:  # reported by the assertions below
            out[name] = exc

    a = threading.Thread(target=run, args=("a", first, "task-a"), daemon=True)
    try:
        a.start()
        state = _until(
            lambda: (s := t.control.control_state()).healthy is False and s,
            "the probe blocked on the row lock never ended as unhealthy",
        )
        assert "timeout" in state.health_reason or "timed out" in state.health_reason
        assert not seen and t.range_status(rnd.round_id)[0].cursor is None  # nothing skipped
        first.request_stop()
        a.join(BOUND)
        assert not a.is_alive(), "a stop request did not end the traversal waiting on health"
        assert out["a"].stopped and not out["a"].complete, out["a"]
        second = traversal(pg_schema_url, redis_url, key_prefix)
        b = threading.Thread(target=run, args=("b", second, "task-b"), daemon=True)
        b.start()
        _until(
            lambda: t.store.range(rnd.round_id, 0).get("lineage") == "task-b",
            "another owner could not take the range over",
        )
        lock.release()  # the database recovers: the new owner finishes the range
        b.join(BOUND)
        assert not b.is_alive() and out["b"].complete, out.get("b")
        assert set(seen) == set(range(1, 501)) and max(seen.values()) == 1
        second.close()
    finally:
        lock.release()
        first.request_stop()
        first.close()
        t.close()


def test_a_mirror_write_blocked_on_a_row_lock_fails_within_its_timeout(pg_engine, pg_schema_url):
    """Scenario: another connection holds the lock of a range's row in ``keyset_checkpoints``;
    a mirror write of that row waits at most ``timeout_seconds`` and raises (old code: waited
    until the lock went, for ever if it never did)."""
    mirror = CheckpointMirror(pg_schema_url, timeout_seconds=1)
    mirror.save_range("s", "r1", 0, {"cursor": "", "state": "pending"})
    lock = RowLock(pg_engine, "SELECT * FROM keyset_checkpoints WHERE range_id = 0 FOR UPDATE")
    out: list[BaseException | None] = []

    def write() -> None:
        try:
            mirror.save_range("s", "r1", 0, {"cursor": "14", "state": "running"})
            out.append(None)
        except BaseException as exc:
            out.append(exc)

    th = threading.Thread(target=write, daemon=True)
    try:
        th.start()
        th.join(BOUND)
        assert not th.is_alive(), "the mirror write waited on the row lock without a limit"
        assert out and isinstance(out[0], sa.exc.OperationalError), out
        assert "timeout" in str(out[0])
    finally:
        lock.release()
        th.join(BOUND)
    mirror.save_range("s", "r1", 0, {"cursor": "14", "state": "running"})  # free again: works
    assert mirror.load_round("s", "r1") is None  # no round row: only ranges were written
    assert mirror.bounded(0.5).timeout_seconds == 0.5 and mirror.bounded(None) is mirror


def test_a_traversal_goes_on_while_its_mirror_row_is_locked(
    pg_engine, pg_schema_url, redis_url, key_prefix, caplog
):
    """Scenario: a traversal with a checkpoint mirror (``lease_seconds=2``) while another
    connection holds the lock of the range's mirror row: each checkpoint write gives up within
    the lease (logged) and the range completes; old code: the range's loop waited on the lock."""
    make_events(pg_engine, list(range(1, 301)))
    t = traversal(pg_schema_url, redis_url, key_prefix, checkpoint_url=pg_schema_url)
    rnd = t.plan(max_ranges=1, new_stream=True)
    lock = RowLock(
        pg_engine,
        "SELECT * FROM keyset_checkpoints WHERE range_id = 0 AND round_id <> '' FOR UPDATE",
    )
    out: list[Any] = []
    opts = TraverseOptions(chunk_size=1000, lease_seconds=2)
    th = threading.Thread(
        target=lambda: out.append(t.traverse(rnd.round_id, 0, lambda c: None, options=opts)),
        daemon=True,
    )
    try:
        th.start()
        th.join(BOUND)
        assert not th.is_alive(), "the range waited on its locked mirror row"
        assert out and out[0].complete and out[0].done == 300
        assert "checkpoint mirror write failed" in caplog.text
    finally:
        lock.release()
        th.join(BOUND)
        t.close()


def test_sqlite_mirror_write_waits_at_most_its_timeout_for_the_write_lock(sqlite_url, tmp_path):
    """SQLite: another connection holds the database's write lock (``BEGIN IMMEDIATE``); a mirror
    write waits at most ``timeout_seconds`` (``PRAGMA busy_timeout``) and raises "database is
    locked"; the pooled connection gets its own busy timeout back afterwards."""
    import sqlite3

    mirror = CheckpointMirror(sqlite_url, timeout_seconds=0.5)
    mirror.save_range("s", "r1", 0, {"cursor": "", "state": "pending"})
    with mirror.engine.connect() as conn:
        before = conn.exec_driver_sql("PRAGMA busy_timeout").scalar()
    other = sqlite3.connect(tmp_path / "source.db", timeout=0, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")
    out: list[BaseException | None] = []

    def write() -> None:
        try:
            mirror.save_range("s", "r1", 0, {"cursor": "14", "state": "running"})
            out.append(None)
        except BaseException as exc:
            out.append(exc)

    th = threading.Thread(target=write, daemon=True)
    try:
        th.start()
        th.join(BOUND)
        assert not th.is_alive() and out and isinstance(out[0], sa.exc.OperationalError), out
        assert "locked" in str(out[0])
    finally:
        other.rollback()
        other.close()
    with mirror.engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() == before
    mirror.save_range("s", "r1", 0, {"cursor": "14", "state": "running"})
