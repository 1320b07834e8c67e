"""``KeysetTraversal.preview``: what a round would be and do, and nothing of it written.

Each database test runs a first round of a stream to the end (so Redis holds a watermark, closed
round and all), adds rows, sets a governor budget, then previews the next round with a processor
that cancels PENDING orders through ``chunk.connection``. Source, target (the same database) and
every Redis key of the test's prefix are snapshotted before and after: equal.
"""

from __future__ import annotations

from typing import Any

import pytest
import redis
import sqlalchemy as sa
from sqlalchemy.pool import NullPool

from airflow_keyset_provider.core import Chunk, ChunkResult, KeysetTraversal
from airflow_keyset_provider.core.writeback import guarded_update

FIRST = 1000  # keys of the first round
TOTAL = 4000  # keys after the rows added behind it
CHUNK = 200


def _status(i: int) -> str:
    return "PAID" if i % 5 == 0 else "PENDING"


def _amount(i: int) -> int:
    return 5000 if i % 7 == 0 else 10  # a cancelled order of 5000 breaks the CHECK


def _create(engine: sa.Engine, mariadb: bool) -> None:
    text_type = "VARCHAR(16)" if mariadb else "text"
    with engine.begin() as c:
        c.exec_driver_sql(
            f"CREATE TABLE orders (id bigint NOT NULL PRIMARY KEY, status {text_type} NOT NULL, "
            "amount bigint NOT NULL, "
            "CONSTRAINT small_cancels CHECK (status <> 'CANCELLED' OR amount < 1000))"
        )


def _insert(engine: sa.Engine, lo: int, hi: int) -> None:
    with engine.begin() as c:
        c.execute(
            sa.text("INSERT INTO orders VALUES (:i, :s, :a)"),
            [{"i": i, "s": _status(i), "a": _amount(i)} for i in range(lo, hi + 1)],
        )


def _analyze(engine: sa.Engine, mariadb: bool) -> None:
    with engine.connect() as c:
        c.exec_driver_sql("ANALYZE TABLE orders" if mariadb else "ANALYZE orders")
        c.commit()


def cancel_pending(chunk: Chunk) -> ChunkResult:
    """Cancel PENDING orders; a PAID one is left alone (not applied), a big one breaks the
    CHECK (failed with the database's reason)."""
    return guarded_update(
        chunk.connection,
        "orders",
        "id",
        chunk.keys,
        values={"status": "CANCELLED"},
        expected={"status": "PENDING"},
    ).to_chunk_result()


def _source_rows(engine: sa.Engine) -> list[tuple]:
    with engine.connect() as c:
        return [tuple(r) for r in c.exec_driver_sql("SELECT * FROM orders ORDER BY id")]


def _tables(engine: sa.Engine) -> list[str]:
    return sorted(sa.inspect(engine).get_table_names())


def _redis_dump(client: redis.Redis, prefix: str) -> dict[bytes, tuple[Any, int]]:
    """Every key of the prefix: its serialised value and whether it has a TTL."""
    out = {}
    for key in client.scan_iter(match=f"{prefix}:*", count=1000):
        out[key] = (client.dump(key), client.ttl(key) > 0)
    return out


def _url(db: str, pg_schema_url: str, mariadb_db_url: str) -> str:
    return pg_schema_url if db == "postgresql" else mariadb_db_url


@pytest.fixture(params=["postgresql", "mariadb"])
def db_url(request: pytest.FixtureRequest) -> str:
    if request.param == "postgresql":
        return request.getfixturevalue("pg_schema_url")
    return request.getfixturevalue("mariadb_db_url")


def test_a_preview_writes_nothing_and_says_what_the_round_would_do(
    db_url: str, redis_url: str, key_prefix: str
) -> None:
    mariadb = db_url.startswith("mysql")
    engine = sa.create_engine(db_url, poolclass=NullPool)
    client = redis.Redis.from_url(redis_url)
    t = KeysetTraversal(
        db_url,
        "orders",
        "id",
        redis_url=redis_url,
        stream="orders",
        key_prefix=key_prefix,
        target_url=db_url,
    )
    try:
        _create(engine, mariadb)
        _insert(engine, 1, FIRST)
        first = t.plan(2, new_stream=True)
        for r in first.ranges:
            t.traverse(first.round_id, r.range_id, lambda chunk: None, chunk_size=500)
        t.close_round(first.round_id)
        _insert(engine, FIRST + 1, TOTAL)
        _analyze(engine, mariadb)
        t.throttle(1000.0)

        before = (_tables(engine), _source_rows(engine), _redis_dump(client, key_prefix))
        preview = t.preview(
            4, processor=cancel_pending, chunk_size=CHUNK, workers=2, sample_chunks=2
        )
        after = (_tables(engine), _source_rows(engine), _redis_dump(client, key_prefix))
    finally:
        t.close()
        client.close()
        engine.dispose()

    assert after == before  # source, target and Redis: nothing written
    doc = preview.as_dict()
    assert (doc["start_key"], doc["end_key"]) == (FIRST, TOTAL)
    assert doc["existing_round"] is None
    assert doc["ranges"][0]["lo"] == FIRST and doc["ranges"][-1]["hi"] == TOTAL
    assert doc["row_estimate"] == "explain"
    assert 0 < doc["estimated_rows"] < 10 * (TOTAL - FIRST)  # an estimate, not a count
    assert doc["chunk_plan"]["scan"] == "index range", doc["chunk_plan"]
    assert doc["chunk_plan"]["problem"] is None
    sample = doc["sample"]
    assert (sample["rows"], sample["chunks"], sample["first_key"]) == (2 * CHUNK, 2, FIRST + 1)
    assert sample["last_key"] == FIRST + 2 * CHUNK
    keys = range(FIRST + 1, FIRST + 1 + 2 * CHUNK)
    paid = [i for i in keys if _status(i) == "PAID"]
    big = [i for i in keys if _status(i) == "PENDING" and _amount(i) >= 1000]
    trial = doc["processor"]
    assert trial["ran"] and trial["rolled_back"] and trial["raised"] is None
    assert (trial["applied"], trial["not_applied"], trial["failed"]) == (
        2 * CHUNK - len(paid) - len(big),
        len(paid),
        len(big),
    )
    assert sum(trial["reasons"].values()) == len(big)
    assert any("small_cancels" in reason for reason in trial["reasons"])
    assert any("failed" in p for p in doc["problems"])
    eta = doc["eta"]
    assert eta["max_rows_per_second"] == 1000.0 and eta["workers"] == 2
    if eta["limited_by"] == "governor budget":
        assert eta["seconds"] == pytest.approx(doc["estimated_rows"] / 1000.0, rel=1e-3)
    else:  # the sample's rate itself is below the budget (a very busy machine)
        assert eta["rows_per_second"] <= 1000.0


def test_a_preview_of_the_open_round_is_that_round(
    pg_schema_url: str, redis_url: str, key_prefix: str
) -> None:
    engine = sa.create_engine(pg_schema_url, poolclass=NullPool)
    t = KeysetTraversal(
        pg_schema_url, "orders", "id", redis_url=redis_url, stream="o", key_prefix=key_prefix
    )
    try:
        _create(engine, False)
        _insert(engine, 1, 300)
        rnd = t.plan(3, new_stream=True)
        _insert(engine, 301, 400)  # after the plan: outside the open round
        preview = t.preview(3, processor=cancel_pending, chunk_size=50)
    finally:
        t.close()
        engine.dispose()
    assert preview.existing_round == rnd.round_id
    assert (preview.start_key, preview.end_key) == (None, 300)
    assert [(r.lo, r.hi) for r in preview.ranges] == [(s.lo, s.hi) for s in rnd.ranges]
    # no target: the processor is not run (its writes could not be rolled back)
    assert not preview.processor.ran and "target" in (preview.processor.why_not or "")


def test_a_preview_after_redis_lost_the_open_round_names_the_round_the_mirror_restores(
    pg_schema_url: str, redis_url: str, redis_client: redis.Redis, key_prefix: str
) -> None:
    """Redis lost the stream, its checkpoint mirror holds the open chained round: the plan would
    restore and return that round, so the preview names it (not a new round from the
    watermark), and restores nothing (Redis stays empty, the mirror unchanged). Found by the
    one-world model (the preview rule, a mirror world after a Redis loss)."""
    engine = sa.create_engine(pg_schema_url, poolclass=NullPool)
    t = KeysetTraversal(
        pg_schema_url,
        "orders",
        "id",
        redis_url=redis_url,
        stream="o",
        key_prefix=key_prefix,
        checkpoint_url=pg_schema_url,
    )
    try:
        _create(engine, False)
        _insert(engine, 1, 300)
        rnd = t.plan(3, new_stream=True)
        _insert(engine, 301, 400)
        for key in redis_client.scan_iter(match=f"{key_prefix}:*", count=1000):
            redis_client.delete(key)  # Redis lost the stream
        with engine.connect() as c:
            mirror_before = c.exec_driver_sql("SELECT * FROM keyset_checkpoints ORDER BY 1, 2, 3")
            mirror_before = [tuple(r) for r in mirror_before]
        preview = t.preview(3, chunk_size=50)
        with engine.connect() as c:
            mirror_after = c.exec_driver_sql("SELECT * FROM keyset_checkpoints ORDER BY 1, 2, 3")
            mirror_after = [tuple(r) for r in mirror_after]
    finally:
        t.close()
        engine.dispose()
    assert preview.existing_round == rnd.round_id
    assert (preview.start_key, preview.end_key) == (None, 300)
    assert [(r.lo, r.hi) for r in preview.ranges] == [(s.lo, s.hi) for s in rnd.ranges]
    assert any("checkpoint mirror" in n for n in preview.notes), preview.notes
    assert _redis_dump(redis_client, key_prefix) == {}  # nothing restored
    assert mirror_after == mirror_before


def test_a_sequential_scan_is_reported_as_a_problem(
    pg_schema_url: str, redis_url: str, key_prefix: str
) -> None:
    engine = sa.create_engine(pg_schema_url, poolclass=NullPool)

    @sa.event.listens_for(engine, "connect")
    def _no_index_scans(dbapi_conn: Any, _record: Any) -> None:
        cur = dbapi_conn.cursor()
        for knob in ("enable_indexscan", "enable_indexonlyscan", "enable_bitmapscan"):
            cur.execute(f"SET {knob} = off")
        cur.close()
        dbapi_conn.commit()

    t = KeysetTraversal(
        engine, "orders", "id", redis_url=redis_url, stream="o", key_prefix=key_prefix
    )
    try:
        _create(engine, False)
        _insert(engine, 1, 2000)
        _analyze(engine, False)
        preview = t.preview(2, chunk_size=100, new_stream=True)
    finally:
        t.close()
        engine.dispose()
    plan = preview.chunk_plan or {}
    assert plan["scan"] == "full scan", plan
    assert any("Seq Scan" in line for line in plan["plan"])
    assert plan["problem"] in preview.problems and "Seq Scan" in plan["problem"]


def test_sqlite_chunk_plan_and_count(sqlite_url: str, redis_url: str, key_prefix: str) -> None:
    engine = sa.create_engine(sqlite_url)
    with engine.begin() as c:
        c.exec_driver_sql(
            "CREATE TABLE orders (id INTEGER PRIMARY KEY, status text NOT NULL, amount int)"
        )
        c.execute(
            sa.text("INSERT INTO orders VALUES (:i, 'PENDING', 1)"),
            [{"i": i} for i in range(1, 501)],
        )
    engine.dispose()
    t = KeysetTraversal(
        sqlite_url,
        "orders",
        "id",
        redis_url=redis_url,
        stream="o",
        key_prefix=key_prefix,
        target_url=sqlite_url,
    )
    try:
        preview = t.preview(2, processor=cancel_pending, chunk_size=100, new_stream=True)
    finally:
        t.close()
    assert preview.row_estimate == "count" and preview.estimated_rows == 500
    assert preview.chunk_plan is not None and preview.chunk_plan["scan"] == "index range"
    assert preview.processor.applied == 250  # the first range (250 keys) in 3 chunks of 100
    engine = sa.create_engine(sqlite_url)
    with engine.connect() as c:
        assert (
            c.exec_driver_sql("SELECT count(*) FROM orders WHERE status='PENDING'").scalar() == 500
        )
    engine.dispose()


def test_a_composite_keys_chunk_query_is_an_index_range_scan(
    db_url: str, redis_url: str, key_prefix: str
) -> None:
    """The chunk query of a composite key, from a cursor inside the range (MariaDB's expanded
    ``a > x OR (a = x AND b > y)``, PostgreSQL's row value): read as an index range."""
    mariadb = db_url.startswith("mysql")
    engine = sa.create_engine(db_url, poolclass=NullPool)
    with engine.begin() as c:
        c.exec_driver_sql(
            "CREATE TABLE pairs (a bigint NOT NULL, b bigint NOT NULL, PRIMARY KEY (a, b))"
        )
        c.execute(
            sa.text("INSERT INTO pairs VALUES (:a, :b)"),
            [{"a": i // 10, "b": i % 10} for i in range(3000)],
        )
    _analyze_table(engine, mariadb, "pairs")
    t = KeysetTraversal(
        db_url, "pairs", ["a", "b"], redis_url=redis_url, stream="p", key_prefix=key_prefix
    )
    try:
        preview = t.preview(1, start_key=(5, 5), end_key=(250, 3), chunk_size=50)
    finally:
        t.close()
        engine.dispose()
    plan = preview.chunk_plan or {}
    assert plan["scan"] == "index range" and plan["problem"] is None, plan
    assert preview.sample is not None and preview.sample.first_key == [5, 6]


def _analyze_table(engine: sa.Engine, mariadb: bool, table: str) -> None:
    with engine.connect() as c:
        c.exec_driver_sql(f"ANALYZE TABLE {table}" if mariadb else f"ANALYZE {table}")
        c.commit()
