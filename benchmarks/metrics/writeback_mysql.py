"""Target 7 on MariaDB/MySQL: the guarded bulk update against what a processor would do per row.

The same three variants as ``writeback.py`` (PostgreSQL), on the ``--mysql-url`` server, in a
database of the run's own (``kbench_wb_<prefix>``, dropped at the end): the project's
``core.writeback.guarded_update`` (one transaction; per batch a locking read and one UPDATE),
one autocommit UPDATE per key, and PyMySQL ``executemany`` in one transaction, all writing
``status = 'DONE' WHERE id = ? AND status = 'PENDING'`` for the same keys, all through PyMySQL.
The table is reset before every timed write, outside the timer; every variant must apply every
key, so the comparison is of equal work.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pymysql
import sqlalchemy as sa

from benchmarks.context import BenchContext
from benchmarks.report import Metric, not_available
from benchmarks.timing import Sample, Stopwatch, interleaved, median_rate, spread

GROUP = "writeback_mysql"
TITLE_ONE = "guarded bulk update vs one autocommit UPDATE per row (MariaDB)"
TITLE_MANY = "guarded bulk update vs executemany (MariaDB)"
WB_SQL = "UPDATE wb SET status = %s WHERE id = %s AND status = %s"


def _raw(url: sa.URL, autocommit: bool) -> Any:
    return pymysql.connect(
        host=url.host or "127.0.0.1",
        port=url.port or 3306,
        user=url.username or "root",
        password=url.password or "",
        database=url.database,
        autocommit=autocommit,
    )


@contextmanager
def _database(ctx: BenchContext, rows: int) -> Iterator[sa.URL]:
    """A database of this run with ``wb(id, status)``, ids 1..rows, dropped afterwards."""
    server = sa.make_url(ctx.mysql_url)
    name = f"kbench_wb_{ctx.prefix}"
    admin = _raw(server.set(database=None), autocommit=True)
    try:
        with admin.cursor() as cur:
            cur.execute(f"CREATE DATABASE `{name}`")
            cur.execute(
                f"CREATE TABLE `{name}`.wb (id INT PRIMARY KEY, status VARCHAR(20) NOT NULL)"
            )
            cur.executemany(
                f"INSERT INTO `{name}`.wb (id, status) VALUES (%s, 'PENDING')",
                [(i,) for i in range(1, rows + 1)],
            )
        yield server.set(database=name)
    finally:
        with admin.cursor() as cur:
            cur.execute(f"DROP DATABASE IF EXISTS `{name}`")
        admin.close()


def _reset(url: sa.URL) -> None:
    conn = _raw(url, autocommit=True)
    try:
        with conn.cursor() as cur:
            cur.execute("UPDATE wb SET status = 'PENDING' WHERE status <> 'PENDING'")
    finally:
        conn.close()


def _project(engine: sa.Engine, guarded_update: Callable[..., Any], keys: list[int]) -> Sample:
    with Stopwatch() as sw, engine.begin() as conn:
        out = guarded_update(
            conn, "wb", "id", keys, values={"status": "DONE"}, expected={"status": "PENDING"}
        )
    return Sample(
        sw.seconds,
        len(out.applied),
        {"not_applied": len(out.not_applied), "failed": len(out.failed)},
    )


def _one_by_one(url: sa.URL, keys: list[int]) -> Sample:
    """One guarded UPDATE per key, autocommit (one round trip and one commit per row)."""
    conn = _raw(url, autocommit=True)
    applied = 0
    try:
        with conn.cursor() as cur, Stopwatch() as sw:
            for k in keys:
                applied += cur.execute(WB_SQL, ("DONE", k, "PENDING"))
    finally:
        conn.close()
    return Sample(sw.seconds, applied)


def _executemany(url: sa.URL, keys: list[int]) -> Sample:
    """PyMySQL ``executemany`` of the guarded UPDATE in one transaction."""
    conn = _raw(url, autocommit=False)
    try:
        with conn.cursor() as cur, Stopwatch() as sw:
            applied = cur.executemany(WB_SQL, [("DONE", k, "PENDING") for k in keys])
            conn.commit()
    finally:
        conn.close()
    return Sample(sw.seconds, applied or 0)


def _fresh(url: sa.URL, fn: Callable[[], Sample]) -> Callable[[], Sample]:
    def go() -> Sample:
        _reset(url)
        return fn()

    return go


def run(ctx: BenchContext) -> list[Metric]:
    names = ("writeback_mysql_vs_onebyone", "writeback_mysql_vs_executemany")
    try:
        from airflow_keyset_provider.core.writeback import guarded_update
    except ImportError as exc:
        note = f"core.writeback.guarded_update not importable: {exc}"
        return [
            not_available(names[0], GROUP, TITLE_ONE, ">= 25x", note),
            not_available(names[1], GROUP, TITLE_MANY, ">= 10x", note),
        ]
    keys = list(range(1, ctx.wb_rows + 1))
    with _database(ctx, len(keys)) as url:
        engine = sa.create_engine(url)
        try:
            _fresh(url, lambda: _project(engine, guarded_update, keys))()  # reflect, warm
            s = interleaved(
                {
                    "project": _fresh(url, lambda: _project(engine, guarded_update, keys)),
                    "one_by_one": _fresh(url, lambda: _one_by_one(url, keys)),
                    "executemany": _fresh(url, lambda: _executemany(url, keys)),
                },
                ctx.repeat,
            )
        finally:
            engine.dispose()
    for name, samples in s.items():
        if any(x.rows != len(keys) for x in samples):
            raise RuntimeError(f"{name} applied {[x.rows for x in samples]} of {len(keys)} keys")
    p, one, many = (median_rate(s[n]) for n in ("project", "one_by_one", "executemany"))
    details = {name: spread(samples) for name, samples in s.items()}
    note = f"{len(keys):,} keys, MariaDB/MySQL via PyMySQL"
    return [
        Metric(
            names[0],
            GROUP,
            TITLE_ONE,
            p,
            one,
            "rows/s",
            p / one,
            ">= 25x",
            p / one >= 25,
            note,
            details,
        ),
        Metric(
            names[1], GROUP, TITLE_MANY, p, many, "rows/s", p / many, ">= 10x", p / many >= 10, note
        ),
    ]
