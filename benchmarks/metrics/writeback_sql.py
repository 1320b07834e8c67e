"""Issue 29: the write-back helpers against the statement a careful engineer writes by hand.

For each database driver, key shape (``id bigint``; ``(created_at, id)``) and helper, the same
keys are written in chunks (1,000 keys; 2,000 for the composite key) inside one transaction on
one SQLAlchemy connection, by the helper and by the hand-written statement on that connection's
DBAPI cursor, each giving the same per-key outcome (applied / not applied), which is checked:

- PostgreSQL (psycopg2, psycopg 3): ``UPDATE t SET status = v.status FROM unnest(%s::bigint[],
  %s::text[]) AS v(id, status) WHERE t.id = v.id AND t.status = 'PENDING' RETURNING t.id`` per
  chunk against ``update_rows`` (rows as mappings), ``update_columns`` (the columnar form) and
  ``guarded_update``; ``INSERT ... SELECT FROM unnest(...) ON CONFLICT (key) DO UPDATE ... WHERE
  status IS DISTINCT FROM excluded.status RETURNING key`` against ``upsert``.
- MariaDB (mysqlclient, PyMySQL): ``SELECT key FROM t WHERE key IN (...) AND status = 'PENDING'
  FOR UPDATE`` + one ``UPDATE t JOIN (SELECT %s AS id, %s AS status UNION ALL ...) v ... SET
  ...`` against ``update_rows``; the same lock + ``UPDATE t SET status = %s WHERE key IN (...)
  AND status = 'PENDING'`` against ``guarded_update``; a lock reading "does status differ"
  + ``INSERT ... ON DUPLICATE KEY UPDATE`` against ``upsert``.

A tenth of the rows are ``SHIPPED`` (the guard fails: not applied); the upsert's input has half
its keys missing (inserted) and, of the others, half unchanged (not applied). The table is
rebuilt before every timed run, outside the timer. Variants run interleaved, ``--repeat``
times; the ratio of a repetition is the baseline's seconds over the helper's, and the metric
reports their min/median/max (the verdict is the median) and the load average at the time.
The old weak baselines (one UPDATE per row, ``executemany``) stay in ``writeback.py`` and
``writeback_mysql.py`` as information.
"""

from __future__ import annotations

import datetime as dt
import importlib.util
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from benchmarks.context import BenchContext
from benchmarks.report import Metric, not_available
from benchmarks.timing import Stopwatch

GROUP_PG = "writeback_sql"
GROUP_MYSQL = "writeback_sql_mysql"
PG_DRIVERS = ("psycopg2", "psycopg")
MYSQL_DRIVERS = ("mysqldb", "pymysql")
SHAPES = ("single", "composite")
PG_OPS = ("update_rows", "update_columns", "guarded_update", "upsert")
MYSQL_OPS = ("update_rows", "guarded_update", "upsert")
PG_TARGET, MYSQL_TARGET = 0.9, 0.8
T0 = dt.datetime(2024, 1, 1, tzinfo=dt.UTC)


def metric_names(group: str) -> tuple[str, ...]:
    drivers, ops = (PG_DRIVERS, PG_OPS) if group == GROUP_PG else (MYSQL_DRIVERS, MYSQL_OPS)
    return tuple(f"{group}_{op}_{d}_{s}" for d in drivers for s in SHAPES for op in ops)


@dataclass(frozen=True)
class Shape:
    """A key shape: its columns, the chunk size, and the keys' values for ids 1..n."""

    name: str
    chunk: int

    @property
    def key(self) -> tuple[str, ...]:
        return ("id",) if self.name == "single" else ("created_at", "id")

    def keys(self, ids: range, aware: bool) -> list[Any]:
        if self.name == "single":
            return list(ids)
        t0 = T0 if aware else T0.replace(tzinfo=None)
        return [(t0 + dt.timedelta(seconds=i), i) for i in ids]


@dataclass
class Outcome:
    seconds: float
    applied: int
    not_applied: int


# ------------------------------------------------------------------ the work, per database


class Database:
    """One database family: its tables, its hand-written statements. ``values``: the columns
    written and their PostgreSQL types (the guard is always ``status = 'PENDING'``)."""

    aware = True
    target = PG_TARGET

    def __init__(
        self,
        engine: sa.Engine,
        table: str,
        shape: Shape,
        rows: int,
        values: dict[str, str] | None = None,
    ) -> None:
        self.engine, self.table, self.shape, self.rows = engine, table, shape, rows
        self.values = values or {"status": "text"}

    def reset(self, op: str) -> None:
        raise NotImplementedError

    def baseline(self, op: str, raw: Any, chunk: list[Any], cols: dict[str, list]) -> set:
        """Write one chunk by hand; the keys applied (the others are not applied)."""
        raise NotImplementedError


def _guard_state(i: int) -> str:
    return "SHIPPED" if i % 10 == 0 else "PENDING"


class Postgres(Database):
    def reset(self, op: str) -> None:
        ids = range(1, self.rows // 2 + 1) if op == "upsert" else range(1, self.rows + 1)
        keys = self.shape.keys(ids, True)
        with self.engine.begin() as conn:
            cur = conn.connection.dbapi_connection.cursor()
            cur.execute(f"TRUNCATE {self.table}")
            if self.shape.name == "single":
                sql = f"INSERT INTO {self.table} SELECT * FROM unnest(%s::bigint[], %s::text[])"
                cur.execute(sql, (keys, [_guard_state(i) for i in ids]))
            else:
                sql = (
                    f"INSERT INTO {self.table} SELECT * FROM "
                    "unnest(%s::timestamptz[], %s::bigint[], %s::text[])"
                )
                cur.execute(sql, ([k[0] for k in keys], list(ids), [_guard_state(i) for i in ids]))
        with self.engine.connect() as conn:
            conn = conn.execution_options(isolation_level="AUTOCOMMIT")
            conn.exec_driver_sql(f"VACUUM ANALYZE {self.table}")

    def baseline(self, op: str, raw: Any, chunk: list[Any], cols: dict[str, list]) -> set:
        key = self.shape.key
        types = {"id": "bigint", "created_at": "timestamptz", **self.values}
        names = [*key, *self.values]
        arrays = ", ".join(f"%s::{types[n]}[]" for n in names)
        ret = ", ".join(key)
        params = [cols[n] for n in names]
        if op == "upsert":
            sets = ", ".join(f"{c} = excluded.{c}" for c in self.values)
            differs = " OR ".join(
                f"{self.table}.{c} IS DISTINCT FROM excluded.{c}" for c in self.values
            )
            sql = (
                f"INSERT INTO {self.table} ({', '.join(names)}) SELECT * FROM unnest({arrays}) "
                f"ON CONFLICT ({ret}) DO UPDATE SET {sets} WHERE {differs} RETURNING {ret}"
            )
        else:
            on = " AND ".join(f"t.{k} = v.{k}" for k in key)
            sets = ", ".join(f"{c} = v.{c}" for c in self.values)
            sql = (
                f"UPDATE {self.table} AS t SET {sets} FROM unnest({arrays}) AS "
                f"v({', '.join(names)}) WHERE {on} AND t.status = 'PENDING' "
                f"RETURNING {', '.join(f't.{k}' for k in key)}"
            )
        with raw.cursor() as cur:
            cur.execute(sql, params)
            found = cur.fetchall()
        return {r[0] for r in found} if len(key) == 1 else {tuple(r) for r in found}


class Mariadb(Database):
    aware = False
    target = MYSQL_TARGET

    def reset(self, op: str) -> None:
        ids = range(1, self.rows // 2 + 1) if op == "upsert" else range(1, self.rows + 1)
        keys = self.shape.keys(ids, False)
        with self.engine.begin() as conn:
            cur = conn.connection.dbapi_connection.cursor()
            cur.execute(f"TRUNCATE TABLE {self.table}")
            if self.shape.name == "single":
                values = [(i, _guard_state(i)) for i in ids]
                sql = f"INSERT INTO {self.table} (id, status) VALUES (%s, %s)"
            else:
                values = [(k[0], i, _guard_state(i)) for k, i in zip(keys, ids, strict=True)]
                sql = f"INSERT INTO {self.table} (created_at, id, status) VALUES (%s, %s, %s)"
            for start in range(0, len(values), 5000):
                cur.executemany(sql, values[start : start + 5000])

    def baseline(self, op: str, raw: Any, chunk: list[Any], cols: dict[str, list]) -> set:
        t, key = self.table, self.shape.key
        n = len(chunk)
        single = len(key) == 1
        flat_keys = chunk if single else [v for k in chunk for v in k]
        one = "%s" if single else f"({', '.join(['%s'] * len(key))})"
        key_in = f"({', '.join(key)}) IN " if not single else f"{key[0]} IN "
        key_in += f"({', '.join([one] * n)})"
        names = (*key, *self.values)
        derived = "SELECT " + ", ".join(f"%s AS {c}" for c in names)
        derived += (" UNION ALL SELECT " + ", ".join(["%s"] * len(names))) * (n - 1)
        flat_rows = [v for row in zip(*(cols[c] for c in names), strict=True) for v in row]
        on = " AND ".join(f"{t}.{k} = v.{k}" for k in key)
        with raw.cursor() as cur:
            if op == "upsert":
                differs = " OR ".join(
                    f"NOT (CAST({t}.{c} AS BINARY) <=> CAST(v.{c} AS BINARY))" for c in self.values
                )
                cur.execute(
                    f"SELECT {', '.join(f'{t}.{k}' for k in key)}, {differs} FROM {t} JOIN "
                    f"({derived}) AS v ON {on} FOR UPDATE",
                    flat_rows,
                )
                unchanged = {
                    (r[0] if single else tuple(r[:-1])) for r in cur.fetchall() if not r[-1]
                }
                row = f"({', '.join(['%s'] * len(names))})"
                sets = ", ".join(f"{c} = VALUES({c})" for c in self.values)
                cur.execute(
                    f"INSERT INTO {t} ({', '.join(names)}) VALUES {', '.join([row] * n)} "
                    f"ON DUPLICATE KEY UPDATE {sets}",
                    flat_rows,
                )
                return {k for k in chunk if k not in unchanged}
            cur.execute(
                f"SELECT {', '.join(key)} FROM {t} WHERE {key_in} AND status = 'PENDING' "
                "FOR UPDATE",
                flat_keys,
            )
            locked = {(r[0] if single else tuple(r)) for r in cur.fetchall()}
            if op == "guarded_update":
                cur.execute(
                    f"UPDATE {t} SET status = %s WHERE {key_in} AND status = 'PENDING'",
                    ["DONE", *flat_keys],
                )
            else:
                sets = ", ".join(f"{t}.{c} = v.{c}" for c in self.values)
                cur.execute(
                    f"UPDATE {t} JOIN ({derived}) AS v ON {on} SET {sets} "
                    f"WHERE {t}.status = 'PENDING'",
                    flat_rows,
                )
        return locked


# ------------------------------------------------------------------ one run of one variant


def _inputs(db: Database, op: str) -> list[tuple[list, dict[str, list], list[dict]]]:
    """Per chunk: the keys, the columns and the rows (built outside the timer: the caller
    has its data in one form already)."""
    shape = db.shape
    ids = range(1, db.rows + 1)
    keys = shape.keys(ids, db.aware)
    status = ["PENDING" if op == "upsert" and i % 4 == 1 else "DONE" for i in ids]
    out = []
    for start in range(0, len(keys), shape.chunk):
        chunk = keys[start : start + shape.chunk]
        part = status[start : start + shape.chunk]
        if shape.name == "single":
            cols = {"id": chunk, "status": part}
        else:
            cols = {"created_at": [k[0] for k in chunk], "id": [k[1] for k in chunk]}
            cols["status"] = part
        rows = [dict(zip(cols, values, strict=True)) for values in zip(*cols.values(), strict=True)]
        out.append((chunk, cols, rows))
    return out


def helper(db: Database, op: str, conn: sa.Connection, chunk: list, cols: dict, rows: list) -> Any:
    """The helper ``op`` on one chunk, given as keys (guarded), columns or rows."""
    from airflow_keyset_provider.core import writeback as wb

    key = list(db.shape.key)
    guard = {"status": "PENDING"}
    if op == "update_rows":
        return wb.update_rows(conn, db.table, key, rows, guard)
    if op == "update_columns":
        return wb.update_columns(conn, db.table, key, cols, guard)
    if op == "guarded_update":
        return wb.guarded_update(conn, db.table, key, chunk, {"status": "DONE"}, guard)
    return wb.upsert(conn, db.table, rows, key, list(db.values))


def _run(db: Database, op: str, variant: str, inputs: list) -> Outcome:
    db.reset(op)
    applied = total = 0
    with Stopwatch() as sw, db.engine.begin() as conn:
        raw = conn.connection.dbapi_connection
        for chunk, cols, rows in inputs:
            if variant == "project":
                out = helper(db, op, conn, chunk, cols, rows)
                if out.failed:
                    raise RuntimeError(f"{op}: {len(out.failed)} keys failed")
                applied += len(out.applied)
            else:
                found = db.baseline(op, raw, chunk, cols)
                applied += len(chunk) - len([k for k in chunk if k not in found])
            total += len(chunk)
    return Outcome(sw.seconds, applied, total - applied)


def _spread(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {"min": ordered[0], "median": ordered[len(ordered) // 2], "max": ordered[-1]}


def _measure(ctx: BenchContext, db: Database, op: str, name: str, group: str) -> Metric:
    inputs = _inputs(db, op)
    title = f"{op} vs hand-written SQL ({name.removeprefix(group + '_').removeprefix(op + '_')})"
    _run(db, op, "project", inputs[:3])  # reflect the table, warm both paths
    _run(db, op, "baseline", inputs[:3])
    runs: dict[str, list[Outcome]] = {"project": [], "baseline": []}
    load = []
    for _ in range(ctx.repeat):
        load.append(os.getloadavg()[0])
        for variant in runs:
            runs[variant].append(_run(db, op, variant, inputs))
    counts = {v: {(o.applied, o.not_applied) for o in outs} for v, outs in runs.items()}
    if counts["project"] != counts["baseline"] or len(counts["project"]) != 1:
        raise RuntimeError(f"{name}: outcomes differ (applied, not applied): {counts}")
    ratios = [b.seconds / p.seconds for p, b in zip(runs["project"], runs["baseline"], strict=True)]
    rates = {v: _spread([db.rows / o.seconds for o in outs]) for v, outs in runs.items()}
    r = _spread(ratios)
    applied, not_applied = next(iter(counts["project"]))
    note = (
        f"{db.rows:,} keys in chunks of {db.shape.chunk:,} ({applied:,} applied, "
        f"{not_applied:,} not); ratio min/median/max {r['min']:.2f}/{r['median']:.2f}/"
        f"{r['max']:.2f}; load average {min(load):.1f}-{max(load):.1f}"
    )
    target = f">= {db.target}x"
    details = {"ratio": r, **rates, "loadavg_1m": load}
    return Metric(
        name,
        group,
        title,
        rates["project"]["median"],
        rates["baseline"]["median"],
        "rows/s",
        r["median"],
        target,
        r["median"] >= db.target,
        note,
        details,
    )


# ------------------------------------------------------------------ the two groups


@contextmanager
def _pg_schema(ctx: BenchContext) -> Iterator[str]:
    schema = f"kbench_wbsql_{ctx.prefix}"
    admin = sa.create_engine(ctx.pg_url, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.exec_driver_sql(f"CREATE SCHEMA {schema}")
            conn.exec_driver_sql(
                f"CREATE TABLE {schema}.single (id bigint PRIMARY KEY, status text NOT NULL)"
            )
            conn.exec_driver_sql(
                f"CREATE TABLE {schema}.composite (created_at timestamptz, id bigint, "
                "status text NOT NULL, PRIMARY KEY (created_at, id))"
            )
        yield schema
    finally:
        with admin.connect() as conn:
            conn.exec_driver_sql(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
        admin.dispose()


def run_pg(ctx: BenchContext) -> list[Metric]:
    out = []
    with _pg_schema(ctx) as schema:
        for driver in PG_DRIVERS:
            url = sa.make_url(ctx.pg_url).set(drivername=f"postgresql+{driver}")
            engine = sa.create_engine(url)
            try:
                for shape_name in SHAPES:
                    shape = Shape(shape_name, 1000 if shape_name == "single" else 2000)
                    db = Postgres(engine, f"{schema}.{shape_name}", shape, ctx.wb_rows)
                    for op in PG_OPS:
                        name = f"{GROUP_PG}_{op}_{driver}_{shape_name}"
                        out.append(_measure(ctx, db, op, name, GROUP_PG))
            finally:
                engine.dispose()
    return out


@contextmanager
def _mysql_database(ctx: BenchContext) -> Iterator[sa.URL]:
    server = sa.make_url(ctx.mysql_url)
    name = f"kbench_wbsql_{ctx.prefix}"
    admin = sa.create_engine(server.set(database=None), isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.exec_driver_sql(f"CREATE DATABASE `{name}`")
            conn.exec_driver_sql(
                f"CREATE TABLE `{name}`.single (id BIGINT PRIMARY KEY, status VARCHAR(20) NOT NULL)"
            )
            conn.exec_driver_sql(
                f"CREATE TABLE `{name}`.composite (created_at DATETIME(6), id BIGINT, "
                "status VARCHAR(20) NOT NULL, PRIMARY KEY (created_at, id))"
            )
        yield server.set(database=name)
    finally:
        with admin.connect() as conn:
            conn.exec_driver_sql(f"DROP DATABASE IF EXISTS `{name}`")
        admin.dispose()


def run_mysql(ctx: BenchContext) -> list[Metric]:
    out: list[Metric] = []
    with _mysql_database(ctx) as url:
        for driver in MYSQL_DRIVERS:
            names = [n for n in metric_names(GROUP_MYSQL) if f"_{driver}_" in n]
            module = "MySQLdb" if driver == "mysqldb" else "pymysql"
            if importlib.util.find_spec(module) is None:
                note = f"{module} is not installed (the mysql-native extra)"
                out += [
                    not_available(n, GROUP_MYSQL, n, f">= {MYSQL_TARGET}x", note) for n in names
                ]
                continue
            engine = sa.create_engine(url.set(drivername=f"mysql+{driver}"))
            try:
                for shape_name in SHAPES:
                    shape = Shape(shape_name, 1000 if shape_name == "single" else 2000)
                    db = Mariadb(engine, shape_name, shape, ctx.wb_rows)
                    for op in MYSQL_OPS:
                        name = f"{GROUP_MYSQL}_{op}_{driver}_{shape_name}"
                        out.append(_measure(ctx, db, op, name, GROUP_MYSQL))
            finally:
                engine.dispose()
    return out


run: Callable[[BenchContext], list[Metric]] = run_pg
