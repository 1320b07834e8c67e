"""``exactly_once=True`` and item retry passes: an item that failed in a committed chunk and was
delivered by a retry pass is never delivered again, whatever Redis loses or forgets afterwards.

The one-world model found it (``mariadb-exactly-once-twice``, docs/reliability.md): the ledger
kept every committed chunk's failed items for good (``keyset_ledger_failed``) and a claim that
passes a committed interval hands them to the retry set again; an item a retry pass had already
delivered (its writes committed in a transaction of their own) was then delivered a second
time. The retry call now resolves the item's row in the ledger in the same transaction as its
writes (``core/run/ledger.py``), so a claim passes it no more, and a retry pass skips an item
whose row another transaction already resolved.

Each scenario writes one row per delivered key into ``effects`` (no unique constraint: a write
done twice shows) on a PostgreSQL, SQLite or MariaDB target (PyMySQL and mysqlclient: InnoDB's
REPEATABLE READ), and closes the round with exact totals. (Real servers.)"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import _services
import pytest
import sqlalchemy as sa
from core_support import make_events, traversal
from sqlalchemy.pool import NullPool
from test_exactly_once_identity import effects, fail_over_to, forget_stream, snapshot, twice

from airflow_keyset_provider.core.chunk import ChunkResult
from airflow_keyset_provider.core.errors import LeaseLostError
from airflow_keyset_provider.core.sql.ledger import ledger_table

TARGETS = ["psycopg2", "sqlite", "pymysql", "mysqldb"]


@pytest.fixture(params=TARGETS)
def target(request, pg_schema_url, tmp_path) -> Iterator[tuple[str, sa.Engine]]:
    """(URL, engine) of the target, holding ``effects`` (no unique key)."""
    kind = request.param
    if kind == "sqlite":
        url = f"sqlite:///{tmp_path / 'target.db'}"
    elif kind in ("pymysql", "mysqldb"):
        if kind == "mysqldb":
            _services.require_module("MySQLdb", _services.MYSQLCLIENT_WHY)
        base = sa.engine.make_url(request.getfixturevalue("mariadb_db_url"))
        url = base.set(drivername=f"mysql+{kind}").render_as_string(hide_password=False)
    else:
        base = sa.engine.make_url(pg_schema_url).set(drivername=f"postgresql+{kind}")
        url = base.render_as_string(hide_password=False)
    engine = sa.create_engine(url, poolclass=NullPool)
    with engine.begin() as c:
        c.execute(sa.text("CREATE TABLE effects (seq bigint NOT NULL)"))
    yield url, engine
    engine.dispose()


class Flaky:
    """Writes each key it is handed, except the ``flaky`` keys on their first delivery: those
    it reports failed (``ChunkResult.failed``) and does not write. ``on_retry`` runs when a
    flaky key comes back (a retry pass), before its write."""

    def __init__(self, flaky: set[int], on_retry: Any = None) -> None:
        self.flaky, self.on_retry = flaky, on_retry
        self.seen: Counter[int] = Counter()

    def __call__(self, chunk: Any) -> ChunkResult:
        failed = {}
        for k in chunk.keys:
            self.seen[k] += 1
            if k in self.flaky and self.seen[k] == 1:
                failed[k] = "flaky, first attempt"
            elif k in self.flaky and self.on_retry is not None:
                self.on_retry()
        ok = [k for k in chunk.keys if k not in failed]
        if ok:
            chunk.connection.execute(
                sa.text("INSERT INTO effects VALUES (:s)"), [{"s": k} for k in ok]
            )
        return ChunkResult(failed=failed)


OPTIONS = dict(chunk_size=10, exactly_once=True, item_retry_delay=0.0, backoff_base=0.001)


def test_a_claim_passing_a_committed_interval_does_not_retry_an_item_a_retry_pass_delivered(
    target, pg_engine, pg_schema_url, redis_url, redis_client, key_prefix
):
    """Key 35 fails in the main pass and a retry pass delivers it; Redis is then failed over to
    a replica cut right after the plan (the range fresh at 0). The next claim passes the ledger's
    committed (0, 100] without reading; it must not hand 35 to the retry set again (it did: the
    ledger kept 35 as failed for good, and 35 was written twice)."""
    url, engine = target
    make_events(pg_engine, list(range(1, 101)))
    t = traversal(pg_schema_url, redis_url, key_prefix, target_url=url)
    rnd = t.plan(max_ranges=1, start_key=0, end_key=100)
    replica = snapshot(redis_client, key_prefix)
    proc = Flaky({35})
    res = t.traverse(rnd.round_id, 0, proc, owner_lineage="a", **OPTIONS)
    assert res.complete and effects(engine) == Counter(range(1, 101))
    fail_over_to(redis_client, key_prefix, replica)
    res = t.traverse(rnd.round_id, 0, proc, owner_lineage="a", **OPTIONS)
    assert res.complete
    assert twice(engine) == [] and proc.seen[35] == 2
    assert effects(engine) == Counter(range(1, 101))
    totals = t.close_round(rnd.round_id)
    assert (totals.done, totals.skipped, totals.dead) == (100, 0, 0)
    t.close()


def test_a_retry_pass_whose_redis_step_was_lost_does_not_deliver_the_item_again(
    target, pg_engine, pg_schema_url, redis_url, redis_client, key_prefix
):
    """Key 35 fails in the main pass; when its retry pass delivers it, Redis is cut there (the
    replica has the range at its end with 35 waiting for retry). The pass commits and Redis
    records it; then the replica is promoted. The next try's retry pass must find 35 delivered
    (its row in the ledger resolved) and pass it without calling the processor."""
    url, engine = target
    make_events(pg_engine, list(range(1, 101)))
    t = traversal(pg_schema_url, redis_url, key_prefix, target_url=url)
    rnd = t.plan(max_ranges=1, start_key=0, end_key=100)
    cut: list[Any] = []
    proc = Flaky({35}, on_retry=lambda: cut or cut.append(snapshot(redis_client, key_prefix)))
    res = t.traverse(rnd.round_id, 0, proc, owner_lineage="a", **OPTIONS)
    assert res.complete and cut and effects(engine) == Counter(range(1, 101))
    fail_over_to(redis_client, key_prefix, cut[0])
    res = t.traverse(rnd.round_id, 0, proc, owner_lineage="a", **OPTIONS)
    assert res.complete
    assert twice(engine) == [] and proc.seen[35] == 2
    totals = t.close_round(rnd.round_id)
    assert (totals.done, totals.dead) == (100, 0)
    t.close()


class FailsTimes:
    """Writes each key it is handed, except that key ``k`` is reported failed (not written) on
    its first ``times[k]`` deliveries."""

    def __init__(self, times: dict[int, int]) -> None:
        self.times = times
        self.seen: Counter[int] = Counter()

    def __call__(self, chunk: Any) -> ChunkResult:
        failed = {}
        for k in chunk.keys:
            self.seen[k] += 1
            if self.seen[k] <= self.times.get(k, 0):
                failed[k] = f"fails its first {self.times[k]} deliveries"
        ok = [k for k in chunk.keys if k not in failed]
        if ok:
            chunk.connection.execute(
                sa.text("INSERT INTO effects VALUES (:s)"), [{"s": k} for k in ok]
            )
        return ChunkResult(failed=failed)


def test_a_retry_call_failed_as_a_whole_keeps_what_the_canary_proved(
    target, pg_engine, pg_schema_url, redis_url, key_prefix
):
    """Keys 10, 20 and 30 fail in the main pass; in the first retry pass (one call of the three)
    10 and 20 fail again and 30 succeeds: two of three failed, the verdict fails the call as a
    whole; the canary succeeds, so the verdict stands (10 and 20 failed on their own, 30 is
    done, not delivered again). The pass's transaction keeps the call's write of 30 (a retry
    pass runs in one transaction with savepoints, as a chunk does: rolling back every call
    that failed as a whole would lose 30), and 10 and 20 are delivered by later passes."""
    url, engine = target
    make_events(pg_engine, list(range(1, 101)))
    t = traversal(pg_schema_url, redis_url, key_prefix, target_url=url)
    rnd = t.plan(max_ranges=1, start_key=0, end_key=100)
    proc = FailsTimes({10: 2, 20: 2, 30: 1})
    options = dict(OPTIONS, max_item_attempts=5)
    res = t.traverse(rnd.round_id, 0, proc, owner_lineage="a", **options)
    assert res.complete
    assert twice(engine) == [] and proc.seen[30] == 2 and proc.seen[10] == 3
    assert effects(engine) == Counter(range(1, 101))
    totals = t.close_round(rnd.round_id)
    assert (totals.done, totals.skipped, totals.dead) == (100, 0, 0)
    t.close()


def test_a_failed_items_table_of_the_earlier_layout_gains_the_resolved_column(
    target, pg_engine, pg_schema_url, redis_url, redis_client, key_prefix
):
    """A ledger created before retry calls were recorded (its failed-items table has no
    ``resolved``) is brought up to date on first use, and the first scenario holds on it."""
    _, engine = target
    with engine.begin() as c:
        ledger_table().intervals.metadata.create_all(c)
        c.execute(sa.text("ALTER TABLE keyset_ledger_failed DROP COLUMN resolved"))
    columns = {c["name"] for c in sa.inspect(engine).get_columns("keyset_ledger_failed")}
    assert "resolved" not in columns
    test_a_claim_passing_a_committed_interval_does_not_retry_an_item_a_retry_pass_delivered(
        target, pg_engine, pg_schema_url, redis_url, redis_client, key_prefix
    )
    columns = {c["name"] for c in sa.inspect(engine).get_columns("keyset_ledger_failed")}
    assert "resolved" in columns


@pytest.mark.parametrize("target", ["psycopg2", "pymysql", "mysqldb"], indirect=True)
def test_a_stale_owners_retry_pass_is_fenced_by_the_item_another_owner_delivered(
    target, pg_engine, pg_schema_url, redis_url, redis_client, key_prefix
):
    """Owner A's retry pass delivers key 35 and stalls inside the call (its write made, not
    committed). Its lease runs out; owner B takes the range over, its retry pass delivers 35
    and commits. When A goes on, its pass must be fenced (``LeaseLostError``) and its write of
    35 rolled back (the retry call committed on its own: 35 written twice). Not on SQLite: A's
    uncommitted write holds its only write lock, so B cannot commit while A stalls."""
    url, engine = target
    make_events(pg_engine, list(range(1, 101)))
    t = traversal(pg_schema_url, redis_url, key_prefix, target_url=url)
    rnd = t.plan(max_ranges=1, start_key=0, end_key=100)
    entered, go = threading.Event(), threading.Event()

    def stall() -> None:
        entered.set()
        assert go.wait(120)

    a = Flaky({35}, on_retry=stall)
    options = dict(OPTIONS, lease_seconds=60)
    ended: list[BaseException | None] = []

    def run_a() -> None:
        try:
            t.traverse(rnd.round_id, 0, a, owner_lineage="a", **options)
            ended.append(None)
        except BaseException as exc:
            ended.append(exc)

    thread = threading.Thread(target=run_a)
    thread.start()
    try:
        assert entered.wait(120)
        owner = redis_client.hget(t.store.range_key(rnd.round_id, 0), "owner")
        t.store.heartbeat(rnd.round_id, 0, owner.decode(), 1)  # A's lease runs out
        time.sleep(0.01)
        b = Flaky({35})
        b.seen[35] = 1  # B's delivery is a retry too
        res = t.traverse(rnd.round_id, 0, b, owner_lineage="b", **options)
        assert res.complete and b.seen[35] == 2
    finally:
        go.set()
        thread.join(120)
    assert len(ended) == 1 and isinstance(ended[0], LeaseLostError), ended
    assert twice(engine) == [] and effects(engine) == Counter(range(1, 101))
    totals = t.close_round(rnd.round_id)
    assert (totals.done, totals.dead) == (100, 0)
    t.close()


def test_a_stream_declared_new_after_a_loss_delivers_every_key_again(
    pg_engine, pg_schema_url, redis_url, redis_client, key_prefix
):
    """Redis loses the stream (no mirror) after round r1 committed every key with the ledger; a
    person declares the stream new (``new_stream=True``): its first round starts below every
    key and must deliver every key again. It is r1 again (Redis's round counter is gone), so
    its claim finds the old r1's committed interval in the ledger and passes it: nothing is
    delivered, and the round counts 100 done."""
    make_events(pg_engine, list(range(1, 101)))
    with pg_engine.begin() as c:
        c.execute(sa.text("CREATE TABLE effects (seq bigint NOT NULL)"))
    t = traversal(pg_schema_url, redis_url, key_prefix, target_url=pg_schema_url)
    first = t.plan(max_ranges=1, new_stream=True)
    proc = Flaky(set())
    assert t.traverse(first.round_id, 0, proc, owner_lineage="a", **OPTIONS).complete
    forget_stream(redis_client, key_prefix)
    again = t.plan(max_ranges=1, new_stream=True)
    assert t.traverse(again.round_id, 0, proc, owner_lineage="a", **OPTIONS).complete
    assert effects(pg_engine) == Counter({k: 2 for k in range(1, 101)})
    t.close()
