"""The source (``core/sql/source.py``) against real PostgreSQL: chunks are index range scans, and a
round's upper bound waits until every key below it has committed (commit order)."""

from __future__ import annotations

import datetime as dt
import re
import threading
import time

import pytest
import sqlalchemy as sa
from core_support import Recorder, make_events, run_all, traversal

from airflow_keyset_provider.core import CommitOrderTimeoutError, KeysetTraversal


def test_chunk_query_is_an_index_range_scan(pg_engine, pg_schema_url, redis_url, key_prefix):
    with pg_engine.begin() as c:
        c.execute(
            sa.text(
                "CREATE TABLE orders (created_at timestamptz NOT NULL, id bigint NOT NULL, "
                "PRIMARY KEY (created_at, id))"
            )
        )
        c.execute(
            sa.text(
                "INSERT INTO orders SELECT now() - make_interval(secs => g / 10.0), g "
                "FROM generate_series(1, 50000) g"
            )
        )
        c.execute(sa.text("ANALYZE orders"))
    t = KeysetTraversal(
        pg_schema_url,
        table="orders",
        key=["created_at", "id"],
        redis_url=redis_url,
        stream="orders",
        key_prefix=key_prefix,
    )
    t.source.validate()
    sql, params_for = t.source.driver_call(t.source._chunk_statement(has_lo=True))
    params = {
        "c0": dt.datetime(2000, 1, 1, tzinfo=dt.UTC),
        "c1": 0,
        "h0": dt.datetime(2100, 1, 1, tzinfo=dt.UTC),
        "h1": 0,
        "n": 1000,
    }
    with pg_engine.connect() as c:
        plan = "\n".join(r[0] for r in c.exec_driver_sql("EXPLAIN " + sql, params_for(params)))
    assert "Index" in plan and "Sort" not in plan and "Seq Scan" not in plan, plan
    assert re.search(r"Index Cond: \(+ROW\(created_at, id\) > ROW\(", plan), plan


def test_commit_order_bound_waits_for_open_transaction(
    pg_engine, pg_schema_url, redis_url, key_prefix
):
    with pg_engine.begin() as c:
        c.execute(sa.text("CREATE TABLE events (seq bigserial PRIMARY KEY, payload text NOT NULL)"))
        c.execute(sa.text("INSERT INTO events (payload) SELECT 'old' FROM generate_series(1, 100)"))
    slow = pg_engine.connect()
    tx = slow.begin()
    slow.execute(
        sa.text("INSERT INTO events (payload) VALUES ('slow')")
    )  # takes seq 101, uncommitted
    with pg_engine.begin() as c:
        c.execute(
            sa.text("INSERT INTO events (payload) VALUES ('fast')")
        )  # seq 102, committed first
    t = traversal(pg_schema_url, redis_url, key_prefix, commit_wait_timeout=30)
    out = {}
    planner = threading.Thread(
        target=lambda: out.setdefault("round", t.plan(max_ranges=2, new_stream=True))
    )
    planner.start()
    time.sleep(0.5)
    assert planner.is_alive(), "plan must wait for the transaction holding seq 101"
    tx.commit()
    slow.close()
    planner.join(10)
    rnd = out["round"]
    assert rnd.end_key == 102
    rec = Recorder()
    run_all(t, rnd, rec)
    assert 101 in rec.seen and sorted(rec.seen) == list(range(1, 103))


def test_commit_order_timeout_names_the_transaction_and_saves_nothing(
    pg_engine, pg_schema_url, redis_url, key_prefix, redis_client
):
    make_events(pg_engine, [1, 2, 3])
    blocker = pg_engine.connect()
    tx = blocker.begin()
    blocker.execute(sa.text("INSERT INTO events VALUES (4, 'held')"))
    try:
        t = traversal(pg_schema_url, redis_url, key_prefix, commit_wait_timeout=0.3)
        with pytest.raises(CommitOrderTimeoutError, match="pid"):
            t.plan(new_stream=True)
    finally:
        tx.rollback()
        blocker.close()
    assert t.store.open_rounds() == []
    assert [k for k in redis_client.scan_iter(f"{key_prefix}:*") if not k.endswith(b":seq")] == []
