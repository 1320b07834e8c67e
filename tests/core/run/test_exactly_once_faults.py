"""``exactly_once`` where it meets failure isolation, long failure histories, case-differing
stream names and lock contention on the target (issue 27 items 3-6). Each writes one row per key
into ``effects`` (no unique constraint). (Real PostgreSQL, MariaDB, SQLite and Redis.)"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from core_support import make_events, traversal
from sqlalchemy.pool import NullPool
from test_exactly_once_identity import effects, target, target_url, write

from airflow_keyset_provider import ChunkResult, RetryableError
from airflow_keyset_provider.core import KeysetTraversal
from airflow_keyset_provider.core.errors import ConfigurationError, DependencyFailedError

_ = target  # a fixture (PostgreSQL with both drivers, SQLite, MariaDB)


def test_an_attempt_that_failed_after_isolation_leaves_nothing_for_a_smaller_reread(
    target, pg_engine, pg_schema_url, redis_url, key_prefix
):
    """Issue 27 item 3. ``where status = 'OPEN'`` over keys 1..60, key 22 not open, chunks of
    20. The chunk 21, 23..41 fails as a whole (the processor wrote, then raised); the canary
    succeeds; the half 21, 23..31 succeeds; the half 32..41 raises ``RetryableError`` while
    key 22 enters the filter. The chunk is read again, smaller in keys (21..40): the savepoint
    of the failed attempt (with the half's writes) must not survive into it (it did: 21, 23..31
    written twice)."""
    url, engine = target
    with pg_engine.begin() as c:
        c.execute(sa.text("CREATE TABLE orders (seq bigint PRIMARY KEY, status text NOT NULL)"))
        c.execute(
            sa.text("INSERT INTO orders VALUES (:s, :st)"),
            [{"s": k, "st": "HOLD" if k == 22 else "OPEN"} for k in range(1, 61)],
        )
    t = traversal(
        pg_schema_url, redis_url, key_prefix, target_url=url, table="orders",
        where="status = 'OPEN'",
    )  # fmt: skip
    rnd = t.plan(max_ranges=1, start_key=0, end_key=60)
    calls: list[list[int]] = []

    def proc(chunk: Any) -> None:
        keys = list(chunk.keys)
        calls.append(keys)
        write(chunk)
        if keys[0] == 21 and len(keys) == 20 and 22 not in keys:
            raise ValueError("the whole chunk failed")
        if keys[0] == 32 and len(calls) < 8:
            with pg_engine.begin() as c:  # a row enters the filter before the re-read
                c.execute(sa.text("UPDATE orders SET status = 'OPEN' WHERE seq = 22"))
            raise RetryableError("the sink went away")

    res = t.traverse(
        rnd.round_id, 0, proc, chunk_size=20, exactly_once=True, backoff_base=0.01,
        item_retry_delay=0.01,
    )  # fmt: skip
    assert res.complete and res.done == 60 and res.dead == 0
    assert [21, 23, 24, 25, 26, 27, 28, 29, 30, 31] in calls  # the half that succeeded
    assert [21, *range(22, 41)] in calls  # the smaller re-read
    assert effects(engine) == Counter(range(1, 61))
    t.close()


def test_a_long_failure_history_on_a_mariadb_target_completes(
    mariadb_db_url, pg_engine, pg_schema_url, redis_url, key_prefix
):
    """Issue 27 item 4. 3,000 keys, every tenth fails with a 230-character reason, on a
    MariaDB target: the failed items are rows of ``keyset_ledger_failed`` written once (the
    history was a JSON column rewritten at every commit, and passed ``TEXT``'s 64 KiB: ``Data
    too long for column 'failed'`` at every try). The range completes, the items are dead
    after their attempts."""
    engine = sa.create_engine(mariadb_db_url, poolclass=NullPool)
    with engine.begin() as c:
        c.execute(sa.text("CREATE TABLE effects (seq bigint NOT NULL)"))
    make_events(pg_engine, list(range(1, 3001)))
    t = traversal(pg_schema_url, redis_url, key_prefix, target_url=mariadb_db_url)
    rnd = t.plan(max_ranges=1, new_stream=True)
    reason = "the partner API refused the record: " + "x" * 194

    def proc(chunk: Any) -> ChunkResult:
        good = [k for k in chunk.keys if k % 10]
        chunk.connection.execute(
            sa.text("INSERT INTO effects VALUES (:s)"), [{"s": k} for k in good]
        )
        return ChunkResult(failed={k: reason for k in chunk.keys if k % 10 == 0})

    assert len(reason) == 230
    res = t.traverse(
        rnd.round_id, 0, proc, chunk_size=100, exactly_once=True, max_item_attempts=2,
        item_retry_delay=0.01,
    )  # fmt: skip
    assert res.complete and (res.done, res.dead) == (2700, 300)
    assert effects(engine) == Counter(k for k in range(1, 3001) if k % 10)
    with engine.connect() as c:
        assert c.execute(sa.text("SELECT count(*) FROM keyset_ledger_failed")).scalar() == 300
    t.close()
    engine.dispose()


def test_streams_whose_names_differ_in_case_have_their_own_ledger_on_mariadb(
    mariadb_db_url, pg_engine, pg_schema_url, redis_url, key_prefix
):
    """Issue 27 item 5. Streams ``Orders`` and ``orders`` over the same 800 keys, one MariaDB
    target: the ledger's identifiers are ``utf8mb4_bin``, so the second stream's round does not
    find the first's intervals (with the database's case-insensitive default it did: it passed
    every key as committed and delivered none)."""
    engine = sa.create_engine(mariadb_db_url, poolclass=NullPool)
    with engine.begin() as c:
        c.execute(sa.text("CREATE TABLE effects (seq bigint NOT NULL)"))
    make_events(pg_engine, list(range(1, 801)))
    delivered: Counter = Counter()

    def proc(chunk: Any) -> None:
        delivered.update(chunk.keys)
        write(chunk)

    for stream in ("Orders", "orders"):
        t = KeysetTraversal(
            pg_schema_url, redis_url=redis_url, stream=stream, key_prefix=key_prefix,
            table="events", key="seq", target_url=mariadb_db_url,
        )  # fmt: skip
        rnd = t.plan(max_ranges=1, new_stream=True)
        res = t.traverse(rnd.round_id, 0, proc, chunk_size=100, exactly_once=True)
        assert res.complete and res.done == 800
        t.close()
    assert delivered == Counter({k: 2 for k in range(1, 801)})
    assert effects(engine) == Counter({k: 2 for k in range(1, 801)})
    engine.dispose()


# -- lock contention on the target (item 6) -------------------------------------------------------


class Contention:
    """A second session on the target that makes the processor's transaction the victim of a
    real deadlock, or of a lock wait timeout, once. ``arm`` is called by the processor with
    its connection (after its writes)."""

    def __init__(self, engine: sa.Engine, kind: str) -> None:
        self.engine, self.kind = engine, kind
        self.mysql = engine.dialect.name == "mysql"
        self.ready, self.release = threading.Event(), threading.Event()
        self.session_id: int | None = None
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None
        with engine.begin() as c:
            c.execute(sa.text("CREATE TABLE locks (id int PRIMARY KEY, v int NOT NULL)"))
            c.execute(sa.text("INSERT INTO locks VALUES (1, 0), (2, 0)"))
            c.execute(sa.text("CREATE TABLE heavy (n int NOT NULL)"))

    def _other(self) -> None:
        try:
            with self.engine.connect() as c, c.begin():
                if self.mysql:
                    self.session_id = c.execute(sa.text("SELECT CONNECTION_ID()")).scalar()
                    # heavier than the processor's transaction: InnoDB rolls back the lighter
                    c.execute(
                        sa.text("INSERT INTO heavy VALUES (:n)"), [{"n": n} for n in range(500)]
                    )
                else:
                    self.session_id = c.execute(sa.text("SELECT pg_backend_pid()")).scalar()
                    # PostgreSQL aborts the session whose deadlock_timeout expires first
                    c.execute(sa.text("SET LOCAL deadlock_timeout = '60s'"))
                c.execute(sa.text("UPDATE locks SET v = v + 1 WHERE id = 2"))
                self.ready.set()
                if self.kind == "deadlock":
                    c.execute(sa.text("UPDATE locks SET v = v + 1 WHERE id = 1"))
                else:
                    self.release.wait(60)
        except BaseException as exc:  # the test asserts on it
            self.error = exc
            self.ready.set()

    def _waiting(self) -> bool:
        with self.engine.connect() as c:
            if self.mysql:
                q = ("SELECT count(*) FROM information_schema.INNODB_TRX "
                     "WHERE trx_state = 'LOCK WAIT' AND trx_mysql_thread_id = :i")  # fmt: skip
            else:
                q = "SELECT count(*) FROM pg_stat_activity WHERE pid = :i AND wait_event_type = 'Lock'"
            return bool(c.execute(sa.text(q), {"i": self.session_id}).scalar())

    def arm(self, conn: sa.Connection) -> None:
        """Called from the processor: lock row 1, let the other session lock row 2 (deadlock)
        or row 1 (lock wait), then ask for the other row: this statement raises."""
        conn.execute(sa.text("UPDATE locks SET v = v + 1 WHERE id = 1"))
        self.thread = threading.Thread(target=self._other)
        self.thread.start()
        try:
            assert self.ready.wait(60) and self.error is None, self.error
            if self.kind == "deadlock":
                deadline = time.monotonic() + 60
                while not self._waiting():  # the other session waits for our row 1
                    assert time.monotonic() < deadline, "the other session never waited"
                    time.sleep(0.02)
                conn.execute(sa.text("UPDATE locks SET v = v + 1 WHERE id = 2"))
            else:
                limit = (
                    "SET SESSION innodb_lock_wait_timeout = 1"
                    if self.mysql
                    else "SET LOCAL lock_timeout = '300ms'"
                )
                conn.execute(sa.text(limit))
                conn.execute(sa.text("UPDATE locks SET v = v + 1 WHERE id = 2"))
        finally:
            self.release.set()

    def join(self) -> None:
        self.release.set()
        if self.thread is not None:
            self.thread.join(60)


@pytest.fixture(params=["psycopg2", "psycopg", "mariadb"])
def locking_target(request, pg_schema_url, tmp_path) -> Iterator[tuple[str, sa.Engine]]:
    url = target_url(request, request.param, pg_schema_url, tmp_path)
    engine = sa.create_engine(url, poolclass=NullPool)
    with engine.begin() as c:
        c.execute(sa.text("CREATE TABLE effects (seq bigint NOT NULL)"))
    yield url, engine
    engine.dispose()


@pytest.mark.parametrize("kind", ["deadlock", "lock_wait"])
@pytest.mark.parametrize("mode", [True, False], ids=["exactly_once", "at_least_once"])
def test_a_deadlock_or_lock_wait_timeout_is_a_dependency_failure(
    kind, mode, locking_target, pg_engine, pg_schema_url, redis_url, key_prefix
):
    """Issue 27 item 6. The processor's transaction on the target loses a real deadlock
    (InnoDB 1213, PostgreSQL 40P01) or lock wait (InnoDB 1205, PostgreSQL 55P03) in the chunk
    11..20: a dependency failure in every mode. The cursor stays, the whole chunk is delivered
    again after a backoff (no isolation: no canary, no halves), every key is written exactly
    once. (On MariaDB with exactly_once the try ended with ``SAVEPOINT ... does not exist``,
    InnoDB having rolled the whole transaction back; elsewhere the chunk was isolated as if
    its items had failed.)"""
    url, engine = locking_target
    make_events(pg_engine, list(range(1, 41)))
    contention = Contention(engine, kind)
    t = traversal(pg_schema_url, redis_url, key_prefix, target_url=url)
    rnd = t.plan(max_ranges=1, new_stream=True)
    calls: list[list[int]] = []

    def proc(chunk: Any) -> None:
        calls.append(list(chunk.keys))
        write(chunk)
        if chunk.keys[0] == 11 and len(calls) == 2:
            contention.arm(chunk.connection)

    try:
        res = t.traverse(
            rnd.round_id, 0, proc, chunk_size=10, exactly_once=mode, backoff_base=0.01,
            group_commit_chunks=2,
        )  # fmt: skip
    finally:
        contention.join()
    assert res.complete and res.done == 40 and res.dead == 0
    assert contention.error is None, contention.error
    # with exactly_once the lost transaction held the group's first chunk too: read again
    starts = (1, 11, 1, 11, 21, 31) if mode else (1, 11, 11, 21, 31)
    assert calls == [list(range(a, a + 10)) for a in starts]  # never isolated
    assert effects(engine) == Counter(range(1, 41))
    t.close()


def test_a_ledger_table_of_the_earlier_layout_is_refused_with_the_fix(
    pg_engine, pg_schema_url, redis_url, key_prefix
):
    """A ``keyset_ledger`` of one row per range id (before the interval ledger) is refused at
    the claim, naming the fix, instead of being written in a layout it does not have."""
    make_events(pg_engine, [1, 2, 3])
    with pg_engine.begin() as c:
        c.execute(sa.text(
            "CREATE TABLE keyset_ledger (stream varchar(200), round_id varchar(200), "
            "range_id integer, epoch bigint, cursor text, done bigint, skipped bigint, "
            "failed text, PRIMARY KEY (stream, round_id, range_id))"
        ))  # fmt: skip
    t = traversal(pg_schema_url, redis_url, key_prefix, target_url=pg_schema_url)
    rnd = t.plan(max_ranges=1, new_stream=True)
    with pytest.raises(ConfigurationError, match=r"earlier layout.*DROP TABLE keyset_ledger"):
        t.traverse(rnd.round_id, 0, write, exactly_once=True)
    assert t.range_status(rnd.round_id)[0]["done"] == 0
    t.close()


def test_a_lock_wait_at_the_claims_ledger_step_is_a_dependency_failure(
    pg_engine, pg_schema_url, redis_url, key_prefix, tmp_path
):
    """Found by the one-world model (``sqlite-claim-lock``, seeds 1 and 2). On a SQLite target
    another writer holds the database's lock through the claim's ledger step (its busy timeout
    is the lease, 1 s): the try ends with ``DependencyFailedError`` (it ended with a raw
    ``sqlite3.OperationalError: database is locked``), the lease released and the cursor where
    it was, so the next try claims at once and finishes; every key once."""
    url = f"sqlite:///{tmp_path / 'target.db'}"
    engine = sa.create_engine(url, poolclass=NullPool)
    with engine.begin() as c:
        c.execute(sa.text("CREATE TABLE effects (seq bigint NOT NULL)"))
    make_events(pg_engine, list(range(1, 41)))
    t = traversal(pg_schema_url, redis_url, key_prefix, target_url=url)
    rnd = t.plan(max_ranges=2, start_key=0, end_key=40)
    kw = dict(chunk_size=10, exactly_once=True, lease_seconds=1, claim_timeout=0)
    assert t.traverse(rnd.round_id, 0, write, **kw).complete  # the ledger tables exist
    with engine.connect() as other:
        other.exec_driver_sql("BEGIN IMMEDIATE")  # another writer holds the lock
        with pytest.raises(DependencyFailedError, match="claim's step in the target's ledger"):
            t.traverse(rnd.round_id, 1, write, **kw)
        other.rollback()
    assert t.range_status(rnd.round_id)[1]["done"] == 0
    res = t.traverse(rnd.round_id, 1, write, **kw)  # claimed at once: the lease was released
    assert res.complete and res.done == 20
    assert effects(engine) == Counter(range(1, 41))
    t.close()
    engine.dispose()
