"""MariaDB, in the same run as PostgreSQL: the engine against a hand-written loop, and plan time.

- ``mariadb_noop_vs_loop``: one ``traverse`` (no-op processor, 10k-row chunks) of a one-range
  round over every row of ``seq`` (bigint primary key, N rows) on MariaDB, against the
  hand-written keyset loop on the *same driver* (the URL's DBAPI module, mysqlclient when it is
  installed): ``SELECT seq ... WHERE seq > %s AND seq <= %s ORDER BY seq LIMIT %s`` on a
  connection of its own with one Redis Lua advance per chunk (``baselines.RedisCursor``), the two
  interleaved. Target: >= 1.00x.
- ``mariadb_plan_time``: median wall time of ``plan(max_ranges=16)`` over that table, explicit
  bounds (the commit-order wait, which depends on other sessions, is not timed). Budget: 1 s at
  10M rows (``--rows 10000000``); the quick run checks the same budget.

The table lives in the database ``<--schema>`` (default ``kbench``) of ``--mariadb-url``
(``KEYSET_BENCH_MARIADB_URL``), built from MariaDB's sequence engine and kept for reuse.

The engine's commit-order wait on MariaDB counts every InnoDB transaction of the *server*
(``INNODB_TRX`` does not say which tables a transaction wrote). On a server shared with other
work, a transaction left open elsewhere would time every plan out; so while this group runs, the
wait counts only the transactions whose current database is the URL's (the query still
runs and is timed; the benchmark's table takes no writes).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from typing import Any

import sqlalchemy as sa
from sqlalchemy.pool import NullPool

from airflow_keyset_provider.core import KeysetTraversal
from airflow_keyset_provider.core.sql.dialects import mysql as mysql_dialect
from benchmarks import project
from benchmarks.baselines import RedisCursor, int_cursor
from benchmarks.context import BenchContext
from benchmarks.report import Metric
from benchmarks.timing import Sample, Stopwatch, interleaved, median_rate, median_seconds, spread

log = logging.getLogger("benchmarks")
TIME_BUDGET_S = 1.0


def _admin(ctx: BenchContext) -> sa.Engine:
    return sa.create_engine(ctx.mariadb_url, poolclass=NullPool, isolation_level="AUTOCOMMIT")


def ensure_table(ctx: BenchContext) -> str:
    """``<schema>.seq_<rows>`` on MariaDB (seq bigint primary key, payload), built if missing."""
    name = f"seq_{ctx.rows}"
    engine = _admin(ctx)
    try:
        with engine.connect() as conn:
            conn.exec_driver_sql(f"CREATE DATABASE IF NOT EXISTS `{ctx.schema}`")
            found = conn.exec_driver_sql(
                "SELECT 1 FROM information_schema.TABLES WHERE TABLE_SCHEMA = %s "
                "AND TABLE_NAME = %s",
                (ctx.schema, name),
            ).first()
            if found is None:
                started = time.perf_counter()
                log.info("creating MariaDB %s.%s with %d rows", ctx.schema, name, ctx.rows)
                conn.exec_driver_sql(
                    f"CREATE TABLE `{ctx.schema}`.`{name}_tmp` (seq BIGINT PRIMARY KEY, "
                    "payload INT NOT NULL) ENGINE=InnoDB"
                )
                conn.exec_driver_sql(
                    f"INSERT INTO `{ctx.schema}`.`{name}_tmp` "
                    f"SELECT seq, MOD(seq, 1000) FROM seq_1_to_{int(ctx.rows)}"
                )
                conn.exec_driver_sql(f"ANALYZE TABLE `{ctx.schema}`.`{name}_tmp`")
                conn.exec_driver_sql(
                    f"RENAME TABLE `{ctx.schema}`.`{name}_tmp` TO `{ctx.schema}`.`{name}`"
                )
                log.info("created %s in %.1f s", name, time.perf_counter() - started)
    finally:
        engine.dispose()
    return f"{ctx.schema}.{name}"


def drop_database(ctx: BenchContext) -> None:
    """Drop the benchmark's MariaDB database (``--drop-schema``)."""
    engine = _admin(ctx)
    try:
        with engine.connect() as conn:
            conn.exec_driver_sql(f"DROP DATABASE IF EXISTS `{ctx.schema}`")
    finally:
        engine.dispose()


def traversal(ctx: BenchContext, table: str, stream: str) -> KeysetTraversal:
    return KeysetTraversal(
        ctx.mariadb_url,
        table=table,
        key="seq",
        redis_url=ctx.redis_url,
        stream=ctx.stream(stream),
        key_prefix=ctx.prefix,
    )


def engine_traverse(ctx: BenchContext, table: str) -> Sample:
    """Plan a one-range round (untimed), then time one ``traverse`` of it."""
    t = traversal(ctx, table, "mariadb")
    try:
        rnd = t.plan(max_ranges=1, start_key=0, end_key=ctx.rows)
        return project.traverse_range(t, rnd, 0, project.noop, ctx.chunk_size)
    finally:
        t.close()


def _dbapi_connect(ctx: BenchContext) -> Any:
    """A plain DBAPI connection of the URL's driver (autocommit), as a hand-written job opens."""
    url = sa.engine.make_url(ctx.mariadb_url)
    module = url.get_dialect().import_dbapi()
    kwargs: dict[str, Any] = {"host": url.host or "127.0.0.1", "user": url.username or "root"}
    kwargs |= {"port": url.port or 3306, "database": url.database or ""}
    if url.password:
        kwargs["password"] = url.password
    conn = module.connect(**kwargs)
    conn.autocommit(True)
    return conn


def keyset_loop(ctx: BenchContext, table: str, lo: int, hi: int, chunk: int) -> Sample:
    """The hand-written bigint keyset loop on the same driver, with one Redis advance a chunk."""
    fence = RedisCursor(ctx, int_cursor(lo))
    sql = f"SELECT seq FROM {table} WHERE seq > %s AND seq <= %s ORDER BY seq LIMIT %s"
    rows_total = chunks = 0
    try:
        with Stopwatch() as sw:
            conn = _dbapi_connect(ctx)
            cur = conn.cursor()
            cursor = lo
            while cursor < hi:
                cur.execute(sql, (cursor, hi, chunk))
                rows = cur.fetchall()
                if not rows:
                    break
                cursor = rows[-1][0]
                fence.advance(int_cursor(cursor), len(rows))
                rows_total += len(rows)
                chunks += 1
            conn.close()
    finally:
        fence.close()
    return Sample(sw.seconds, rows_total, {"chunks": chunks})


def timed_plan(ctx: BenchContext, table: str) -> Sample:
    t = traversal(ctx, table, "mariadb-plan")
    try:
        with Stopwatch() as sw:
            rnd = t.plan(max_ranges=ctx.ranges, start_key=0, end_key=ctx.rows)
    finally:
        t.close()
    return Sample(sw.seconds, 0, {"ranges": len(rnd.ranges)})


@contextlib.contextmanager
def _wait_for_this_database_only(ctx: BenchContext) -> Iterator[None]:
    """See the module doc: the commit-order wait ignores other databases' transactions."""
    listed = mysql_dialect.open_transactions
    mark = f" database {sa.engine.make_url(ctx.mariadb_url).database} transaction "

    def ours(conn: sa.Connection, *watch: Any, **kw: Any) -> dict[str, Any]:
        return {k: b for k, b in listed(conn, *watch, **kw).items() if mark in b.describe}

    mysql_dialect.open_transactions = ours  # type: ignore[assignment]
    try:
        yield
    finally:
        mysql_dialect.open_transactions = listed


def run(ctx: BenchContext) -> list[Metric]:
    with _wait_for_this_database_only(ctx):
        return _run(ctx)


def _run(ctx: BenchContext) -> list[Metric]:
    table = ensure_table(ctx)
    driver = sa.engine.make_url(ctx.mariadb_url).get_driver_name()
    keyset_loop(ctx, table, 0, ctx.rows, ctx.chunk_size)  # warm the buffer pool, untimed
    s = interleaved(
        {
            "project": lambda: engine_traverse(ctx, table),
            "loop": lambda: keyset_loop(ctx, table, 0, ctx.rows, ctx.chunk_size),
        },
        ctx.repeat,
    )
    for name, samples in s.items():
        if any(x.rows != ctx.rows for x in samples):
            raise RuntimeError(f"{name} read {[x.rows for x in samples]} rows, expected {ctx.rows}")
    p, loop = median_rate(s["project"]), median_rate(s["loop"])
    plans = [timed_plan(ctx, table) for _ in range(ctx.repeat)]
    t_plan = median_seconds(plans)
    return [
        Metric(
            "mariadb_noop_vs_loop",
            "mariadb",
            f"MariaDB: no-op processor vs hand-written keyset loop + Redis advance ({driver})",
            p,
            loop,
            "rows/s",
            p / loop,
            ">= 1.00x",
            p / loop >= 1.0,
            f"driver {driver}, chunk {ctx.chunk_size}",
            {name: spread(samples) for name, samples in s.items()},
        ),
        Metric(
            "mariadb_plan_time",
            "mariadb",
            f"MariaDB: plan {ctx.ranges} ranges over N rows",
            t_plan,
            TIME_BUDGET_S,
            "s",
            t_plan / TIME_BUDGET_S,
            "<= 1.00x (1 s at 10M)",
            t_plan <= TIME_BUDGET_S,
            f"{ctx.rows:,} rows; ranges planned: {[x.extra['ranges'] for x in plans]}",
            spread(plans, rate=False),
        ),
    ]
