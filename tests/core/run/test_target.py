"""``target_url``: each processor call writes through ``chunk.connection``, in a transaction the
engine began for that call: committed when the processor returns (its ``ChunkResult``
included), rolled back when it raises (real PostgreSQL + Redis)."""

from __future__ import annotations

from collections import Counter

import sqlalchemy as sa
from core_support import make_events, traversal

from airflow_keyset_provider import ChunkResult, RetryableError
from airflow_keyset_provider.core.sql.target import make_target_engine


def _effects(engine: sa.Engine) -> Counter:
    with engine.connect() as c:
        return Counter(r[0] for r in c.execute(sa.text("SELECT seq FROM effects")))


def _prepare(engine: sa.Engine, n: int) -> None:
    make_events(engine, list(range(1, n + 1)))
    with engine.begin() as c:  # no unique constraint: a write done twice would show
        c.execute(sa.text("CREATE TABLE effects (seq bigint NOT NULL)"))


def _write(chunk) -> None:
    chunk.connection.execute(
        sa.text("INSERT INTO effects VALUES (:s)"), [{"s": k} for k in chunk.keys]
    )


def test_a_returning_processor_commits_its_writes(pg_engine, pg_schema_url, redis_url, key_prefix):
    _prepare(pg_engine, 250)
    t = traversal(pg_schema_url, redis_url, key_prefix, target_url=pg_schema_url)
    rnd = t.plan(max_ranges=1, new_stream=True)
    res = t.traverse(rnd.round_id, 0, _write, chunk_size=100)
    assert res.complete and res.done == 250
    assert _effects(pg_engine) == Counter(range(1, 251))
    t.close()


def test_a_raising_processor_leaves_nothing_of_that_call(
    pg_engine, pg_schema_url, redis_url, key_prefix
):
    """The first delivery of each chunk writes, then raises ``RetryableError`` (a dependency
    went down after the write): that write is rolled back, the chunk is delivered again, and
    each key is written exactly once."""
    _prepare(pg_engine, 200)
    attempts: Counter = Counter()

    def flaky(chunk) -> None:
        _write(chunk)
        attempts[chunk.keys[0]] += 1
        if attempts[chunk.keys[0]] == 1:
            raise RetryableError("the sink went away after the insert")

    t = traversal(pg_schema_url, redis_url, key_prefix, target_url=pg_schema_url)
    rnd = t.plan(max_ranges=1, new_stream=True)
    res = t.traverse(rnd.round_id, 0, flaky, chunk_size=50, backoff_base=0.01)
    assert res.complete and res.done == 200
    assert sum(attempts.values()) == 8  # 4 chunks, each delivered twice
    assert _effects(pg_engine) == Counter(range(1, 201))
    t.close()


def test_the_writes_for_keys_a_result_does_not_fail_stand(
    pg_engine, pg_schema_url, redis_url, key_prefix
):
    _prepare(pg_engine, 30)

    def some_bad(chunk) -> ChunkResult:
        good = [k for k in chunk.keys if k % 10]
        chunk.connection.execute(
            sa.text("INSERT INTO effects VALUES (:s)"), [{"s": k} for k in good]
        )
        return ChunkResult(failed={k: "multiple of ten" for k in chunk.keys if k % 10 == 0})

    t = traversal(pg_schema_url, redis_url, key_prefix, target_url=pg_schema_url)
    rnd = t.plan(max_ranges=1, new_stream=True)
    res = t.traverse(rnd.round_id, 0, some_bad, chunk_size=30, max_item_attempts=1)
    assert (res.done, res.dead) == (27, 3)
    assert _effects(pg_engine) == Counter(k for k in range(1, 31) if k % 10)
    t.close()


def test_without_a_target_a_chunk_has_no_connection(
    pg_engine, pg_schema_url, redis_url, key_prefix
):
    make_events(pg_engine, [1, 2, 3])
    seen = []
    t = traversal(pg_schema_url, redis_url, key_prefix)
    rnd = t.plan(max_ranges=1, new_stream=True)
    t.traverse(rnd.round_id, 0, lambda chunk: seen.append(chunk.connection), chunk_size=10)
    assert seen == [None]


def test_the_target_engine_hides_bound_parameters(pg_schema_url, monkeypatch):
    monkeypatch.delenv("AIRFLOW_KEYSET_LOG_ROW_DATA", raising=False)
    assert make_target_engine(pg_schema_url).hide_parameters is True
    monkeypatch.setenv("AIRFLOW_KEYSET_LOG_ROW_DATA", "1")
    assert make_target_engine(pg_schema_url).hide_parameters is False
