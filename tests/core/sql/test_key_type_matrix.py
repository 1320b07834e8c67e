"""Every key type, generated from the databases' own catalogs, not chosen (issue 27).

For each entry of a catalog walk (PostgreSQL: every base type, range and multirange of
``pg_catalog``, an array, an enum, a composite, domains, the types of the extensions available
here, every collation kind, inheritance and partitioned tables; MariaDB: every data type its help
tables list and every collation of ``information_schema.COLLATIONS`` for utf8mb4 (all character
sets in long mode); SQLite: every declared type SQLAlchemy knows, STRICT or not, the rowid alias,
and the collations BINARY, NOCASE and RTRIM) exactly one of two things holds:

- the plan refuses, naming the column, the type and a fix; or
- the engine traverses two chained rounds over the type's edge values (minimum, maximum, empty
  string, trailing spaces, tabs, supplementary characters, ...) and delivers every row of the
  table exactly once (delivered keys compared with the table's).

Values a type holds but the key codec cannot (infinities, NaN, years past 9999 or BC, zero dates,
another SQLite storage class) make the plan refuse, naming the column and the fix.
"""

from __future__ import annotations

import contextlib
import re
import sqlite3
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from core_support import Recorder, run_all
from modes import LONG
from sqlalchemy.dialects.sqlite import base as sqlite_base
from sqlalchemy.engine import make_url
from sqlalchemy.pool import NullPool

from airflow_keyset_provider.core import KeysetTraversal
from airflow_keyset_provider.core.errors import KeyValidationError
from airflow_keyset_provider.core.sql import key_types

# --------------------------------------------------------------------------- the two outcomes


class Walk:
    """Runs each catalog entry against one database; counts outcomes for the final assertion."""

    def __init__(self, url: str, redis_url: str, key_prefix: str) -> None:
        self.url, self.redis_url, self.key_prefix = url, redis_url, key_prefix
        self.refused: dict[str, str] = {}
        self.traversed: dict[str, int] = {}
        self.n = 0

    def report(self, what: str) -> None:
        """One line per walk in the test log: what was traversed, how much was refused."""
        print(
            f"{what}: {len(self.traversed)} traversed ({', '.join(sorted(self.traversed))}); "
            f"{len(self.refused)} refused"
        )

    def traversal(self, table: str, key: str | list[str] = "k") -> KeysetTraversal:
        self.n += 1
        return KeysetTraversal(
            self.url,
            table,
            key,
            redis_url=self.redis_url,
            stream=f"m{self.n}",
            key_prefix=self.key_prefix,
        )

    def refusal(self, entry: str, table: str, type_words: list[str], key: str = "k") -> str:
        """The plan of ``table`` is refused naming the column, the type and a fix."""
        t = self.traversal(table, key)
        try:
            with pytest.raises(KeyValidationError) as info:
                t.plan(max_ranges=2, new_stream=True)
        finally:
            t.close()
        msg = str(info.value)
        assert f"'{key}'" in msg or f"({key})" in msg, f"{entry}: names no column: {msg}"
        assert "Fix:" in msg, f"{entry}: refusal gives no fix: {msg}"
        # a refusal of the type names it; one of the collation or the index names those
        for w in type_words if "has type" in msg else []:
            assert w.lower() in msg.lower(), f"{entry}: refusal does not name {w!r}: {msg}"
        self.refused[entry] = msg
        return msg

    def outcome(
        self,
        entry: str,
        table: str,
        type_words: list[str],
        insert: Callable[[list[Any]], None],
        read_keys: Callable[[], list[Any]],
        values: list[Any],
    ) -> None:
        """Refused, or two chained rounds deliver every row exactly once."""
        t = self.traversal(table)
        try:
            try:
                t.source.validate()
            except KeyValidationError:
                self.refusal(entry, table, type_words)
                return
            insert(values)
            ordered = read_keys()  # the database's own order
            assert len(ordered) == len(set(map(repr, ordered))) == len(values), entry
            first, second = ordered[: len(ordered) // 2], ordered[len(ordered) // 2 :]
            # round 1 sees the lower half only: delete the upper half, put it back afterwards
            delivered = self._rounds(t, entry, first, second, insert, read_keys)
        finally:
            t.close()
        assert sorted(map(repr, delivered)) == sorted(map(repr, ordered)), (
            f"{entry}: delivered {delivered!r}, table holds {ordered!r}"
        )
        self.traversed[entry] = len(delivered)

    def _rounds(self, t, entry, first, second, insert, read_keys) -> list[Any]:  # type: ignore[no-untyped-def]
        self._delete(t, second)
        out: list[Any] = []
        for expect in (first, second):
            if expect is second:
                insert(second)
            rnd = t.plan(max_ranges=2, new_stream=True)
            rec = Recorder()
            run_all(t, rnd, rec, chunk_size=3)
            assert t.close_round(rnd.round_id).done == len(expect), entry
            assert max(rec.seen.values(), default=1) == 1, f"{entry}: delivered twice {rec.seen}"
            out += list(rec.seen)
        return out

    @staticmethod
    def _delete(t: KeysetTraversal, keys: list[Any]) -> None:
        src = t.source
        cols = [src.table.c[n] for n in src.key_names]
        with src.engine.begin() as c:
            for k in keys:
                parts = k if len(cols) > 1 else (k,)
                cond = [
                    col == sa.bindparam(f"v{i}", v, type_=col.type)
                    for i, (col, v) in enumerate(zip(cols, parts, strict=True))
                ]
                c.execute(sa.delete(src.table).where(*cond))

    def composite(self, entry: str, ddl: list[str], values: list[Any]) -> None:
        """After ``entry`` traversed alone: the same type as the second column of a key
        ``(g, k)`` (row-value comparisons, MariaDB's expanded form), each value under g = 1 and
        g = 2; two chained rounds deliver every row once. ``ddl`` creates table ``tc``."""
        if entry not in self.traversed:
            return
        engine = sa.create_engine(self.url)
        try:
            with engine.begin() as c:
                for stmt in ddl:
                    c.exec_driver_sql(stmt)

            def insert(keys: list[Any]) -> None:
                with engine.begin() as c:
                    for g, v in keys:
                        c.execute(
                            sa.text("INSERT INTO tc (g, k) VALUES (:g, :k)"), {"g": g, "k": v}
                        )

            def read() -> list[Any]:
                with engine.connect() as c:
                    return [
                        tuple(r) for r in c.execute(sa.text("SELECT g, k FROM tc ORDER BY g, k"))
                    ]

            t = self.traversal("tc", ["g", "k"])
            try:
                t.source.validate()
                insert([(g, v) for g in (1, 2) for v in values])
                ordered = read()
                half = len(ordered) // 2
                delivered = self._rounds(t, entry, ordered[:half], ordered[half:], insert, read)
            finally:
                t.close()
            assert sorted(map(repr, delivered)) == sorted(map(repr, ordered)), (
                f"{entry} as (g, k): delivered {delivered!r}, table holds {ordered!r}"
            )
            self.traversed[f"(g, {entry})"] = len(delivered)
            with engine.begin() as c:
                c.exec_driver_sql("DROP TABLE tc")
        finally:
            engine.dispose()


# --------------------------------------------------------------------------- PostgreSQL


@pytest.fixture
def pg_db(pg_url: str) -> Iterator[tuple[str, sa.Engine]]:
    """A throwaway database (URL, engine): each plan waits for the open transactions of its
    database (commit order), so other tests' transactions in the shared one would slow the walk."""
    name = f"kt_types_{uuid.uuid4().hex[:8]}"
    admin = sa.create_engine(pg_url, isolation_level="AUTOCOMMIT", poolclass=NullPool)
    with admin.connect() as c:
        c.exec_driver_sql(f'CREATE DATABASE "{name}"')
    url = make_url(pg_url).set(database=name).render_as_string(hide_password=False)
    engine = sa.create_engine(url)
    try:
        yield url, engine
    finally:
        engine.dispose()
        with admin.connect() as c:
            c.exec_driver_sql(f'DROP DATABASE "{name}" WITH (FORCE)')
        admin.dispose()


_PG_EDGES: dict[str, list[str]] = {
    "int2": ["-32768", "32767", "0", "-1", "1"],
    "int4": ["-2147483648", "2147483647", "0", "-1", "7"],
    "int8": ["-9223372036854775808", "9223372036854775807", "0", "-1", "7"],
    "numeric": ["-1e130", "1e130", "0", "1.5", "-0.000000000001", "1e-130"],
    "text": ["", " ", "a", "a ", "a\t", "\t", "b", "A", "é", "\U0001f600", "\x7f", "a  "],
    "timestamp": [
        "0001-01-01 00:00:00",
        "9999-12-31 23:59:59.999999",
        "1970-01-01 00:00:00",
        "2000-02-29 12:00:00.5",
    ],
    "timestamptz": [
        "0001-01-01 00:00:00+00",
        "9999-12-31 23:59:59.999999+00",
        "1970-01-01 00:00:00+00",
        "2000-02-29 12:00:00.5+05:30",
    ],
    "date": ["0001-01-01", "9999-12-31", "2000-02-29", "1970-01-01"],
    "uuid": [
        str(uuid.UUID(int=0)),
        str(uuid.UUID(int=2**128 - 1)),
        "00000000-0000-0000-0000-000000000100",
        "01000000-0000-0000-0000-000000000000",
        str(uuid.UUID(int=2**127)),
    ],
}
_PG_EDGES["varchar"] = _PG_EDGES["text"]
#: values a type holds that the plan must refuse (leading key column)
_PG_BAD: dict[str, list[str]] = {
    "numeric": ["NaN", "Infinity", "-Infinity"],
    "timestamp": ["infinity", "-infinity", "10000-01-01 00:00:00", "0001-01-01 00:00:00 BC"],
    "timestamptz": ["infinity", "-infinity", "10000-01-01 00:00:00+00", "0001-01-01 BC"],
    "date": ["infinity", "-infinity", "10000-01-01", "0001-01-01 BC"],
}


def _pg_catalog_types(conn: sa.Connection) -> list[tuple[str, str, str]]:
    """(typname, format_type, typtype) of every base, range and multirange type of pg_catalog
    that a column may have (no pseudo-types, no row types of system tables, no arrays)."""
    return [
        tuple(r)
        for r in conn.execute(
            sa.text(
                "SELECT t.typname, format_type(t.oid, NULL), t.typtype::text FROM pg_type t "
                "JOIN pg_namespace n ON n.oid = t.typnamespace WHERE n.nspname = 'pg_catalog' "
                "AND t.typtype IN ('b', 'r', 'm') AND t.typisdefined AND t.typcategory <> 'A' "
                "AND NOT (t.typelem <> 0 AND t.typlen > 0 AND t.typcategory <> 'S') "
                "ORDER BY t.typname"
            )
        )
    ]


def _pg_create(conn: sa.Connection, table: str, type_sql: str, extra: str = "") -> bool:
    """A table keyed by ``k`` of the type: with a primary key if the type has a btree, else a
    plain NOT NULL column (the type check comes first either way)."""
    for ddl in (
        f"CREATE TABLE {table} (k {type_sql} NOT NULL PRIMARY KEY{extra})",
        f"CREATE TABLE {table} (k {type_sql} NOT NULL{extra})",
    ):
        try:
            with conn.begin_nested():
                conn.exec_driver_sql(ddl)
            return True
        except sa.exc.DBAPIError:
            continue
    return False


def _pg_entry(walk: Walk, engine: sa.Engine, table: str, typname: str, label: str) -> None:
    def insert(values: list[Any]) -> None:
        with engine.begin() as c:
            for v in values:
                c.exec_driver_sql(f"INSERT INTO {table} (k) VALUES (%(v)s)", {"v": v})

    def read() -> list[Any]:
        with engine.connect() as c:
            return [r[0] for r in c.exec_driver_sql(f"SELECT k FROM {table} ORDER BY k")]

    edges = _PG_EDGES.get(typname)
    if edges is None:  # no edge values: the rule must refuse it, without a row
        walk.refusal(label, table, [label.split("(")[0].strip('"')])
        return
    walk.outcome(label, table, [label.split("(")[0].strip('"')], insert, read, edges)
    walk.composite(label, _pg_composite_ddl(table), edges)
    if walk.traversed.get(label) is not None:
        for bad in _PG_BAD.get(typname, []):
            insert([bad])
            msg = walk.refusal(f"{label} holding {bad}", table, [])
            assert "holds" in msg, msg
            with engine.begin() as c:
                c.exec_driver_sql(f"DELETE FROM {table} WHERE k = %(v)s", {"v": bad})


def test_postgresql_catalog_walk(pg_db, redis_url, key_prefix):
    pg_schema_url, pg_engine = pg_db
    walk = Walk(pg_schema_url, redis_url, key_prefix)
    n = 0
    with pg_engine.connect() as conn:
        types = _pg_catalog_types(conn)
        exts = {
            r[0]
            for r in conn.exec_driver_sql(
                "SELECT name FROM pg_available_extensions WHERE installed_version IS NULL"
            )
        }
    entries: list[tuple[str, str, str]] = [(t, label, label) for t, label, _ in types]
    with pg_engine.begin() as c:
        c.exec_driver_sql("CREATE TYPE mood AS ENUM ('paid', 'archived', 'open')")
        c.exec_driver_sql("CREATE TYPE pair AS (a int, b int)")
        c.exec_driver_sql("CREATE DOMAIN big AS int8 CHECK (VALUE IS NOT NULL)")
        c.exec_driver_sql('CREATE DOMAIN label AS text COLLATE "C"')
        c.exec_driver_sql("CREATE DOMAIN bigger AS big")  # a domain over a domain
        c.exec_driver_sql("CREATE DOMAIN ord AS mood")
        icu = c.exec_driver_sql(
            "SELECT collname FROM pg_collation WHERE collprovider = 'i' ORDER BY collname LIMIT 1"
        ).scalar()
        if icu:  # a domain over text whose own collation is not byte order
            c.exec_driver_sql(f'CREATE DOMAIN icu_label AS text COLLATE "{icu}"')
        for ext in ("citext", "ltree", "isn", "hstore", "cube", "seg"):
            if ext in exts:
                c.exec_driver_sql(f'CREATE EXTENSION "{ext}"')
        ext_types = [
            (r[0], r[0], r[0])
            for r in c.exec_driver_sql(
                "SELECT t.typname FROM pg_type t JOIN pg_namespace n ON n.oid = t.typnamespace "
                "WHERE n.nspname = current_schema() AND t.typtype = 'b' AND t.typcategory <> 'A'"
            )
        ]
    entries += [
        ("enum", "mood", "mood"),
        ("composite", "pair", "pair"),
        ("array", "integer[]", "integer[]"),
        ("int8", "big", "big"),
        ("text", "label", "label"),
        ("int8", "bigger", "bigger"),
        ("enum", "ord", "ord"),
        *([("text", "icu_label", "icu_label")] if icu else []),
        *ext_types,
    ]
    for typname, type_sql, label in entries:
        n += 1
        table = f"t{n}"
        with pg_engine.begin() as c:
            if not _pg_create(c, table, type_sql):
                continue  # a type no column may have (e.g. unknown); nothing to page by
        _pg_entry(walk, pg_engine, table, typname, label)
    assert {"mood", "ord", "pair", "integer[]", "character", '"char"'} <= set(walk.refused)
    assert not icu or "collation" in walk.refused["icu_label"], walk.refused.get("icu_label")
    assert {"bigint", "text", "timestamp with time zone", "uuid", "big", "bigger"} <= set(
        walk.traversed
    ), walk.traversed
    assert len(walk.refused) + len(walk.traversed) > 80
    walk.report("PostgreSQL types")


def test_postgresql_collations_and_table_kinds(pg_db, redis_url, key_prefix):
    pg_schema_url, pg_engine = pg_db
    walk = Walk(pg_schema_url, redis_url, key_prefix)
    with pg_engine.connect() as conn:
        colls = [
            tuple(r)
            for r in conn.execute(
                sa.text(
                    "SELECT collname, collprovider::text, collisdeterministic FROM pg_collation "
                    "WHERE collencoding IN (-1, pg_char_to_encoding('UTF8')) ORDER BY collname"
                )
            )
        ]
    with pg_engine.begin() as c, contextlib.suppress(sa.exc.DBAPIError), c.begin_nested():
        c.exec_driver_sql(
            "CREATE COLLATION nd (provider = icu, locale = 'und-u-ks-level2', "
            "deterministic = false)"
        )
        colls.append(("nd", "i", False))
    seen_kinds: set[tuple[str, bool]] = set()
    for i, (name, provider, deterministic) in enumerate(colls):
        kind = (provider, deterministic)
        if provider == "i" and kind in seen_kinds and not LONG and name != "nd":
            continue  # short mode: one ICU collation per kind (all of them in long mode)
        seen_kinds.add(kind)
        table = f"c{i}"
        with pg_engine.begin() as c:
            c.exec_driver_sql(
                f'CREATE TABLE {table} (k text COLLATE "{name}" NOT NULL PRIMARY KEY)'
            )
        walk.outcome(
            f"collation {name}",
            table,
            [name],
            lambda vs, t=table: _pg_insert(pg_engine, t, vs),
            lambda t=table: _pg_read(pg_engine, t),
            _PG_EDGES["text"],
        )
        walk.composite(f"collation {name}", _pg_composite_ddl(table), _PG_EDGES["text"])
    assert "collation C" in walk.traversed and "collation POSIX" in walk.traversed
    assert "collation nd" in walk.refused or ("i", False) not in seen_kinds
    # table kinds: an INHERITS parent is refused, its child and a partitioned table traverse
    with pg_engine.begin() as c:
        c.exec_driver_sql("CREATE TABLE parent (k bigint PRIMARY KEY)")
        c.exec_driver_sql("CREATE TABLE child (k bigint PRIMARY KEY) INHERITS (parent)")
        c.exec_driver_sql("CREATE TABLE part (k bigint PRIMARY KEY) PARTITION BY RANGE (k)")
        c.exec_driver_sql(
            "CREATE TABLE part_lo PARTITION OF part FOR VALUES FROM (MINVALUE) TO (0)"
        )
        c.exec_driver_sql(
            "CREATE TABLE part_hi PARTITION OF part FOR VALUES FROM (0) TO (MAXVALUE)"
        )
        c.exec_driver_sql("INSERT INTO parent VALUES (1)")
        c.exec_driver_sql("INSERT INTO child VALUES (1)")  # the same key twice through parent
    msg = walk.refusal("INHERITS parent", "parent", ["INHERITS"])
    assert "partition" in msg
    ints = ["-9223372036854775808", "9223372036854775807", "0", "-1", "5"]
    for table in ("child", "part"):
        with pg_engine.begin() as c:
            c.exec_driver_sql(f"DELETE FROM {table}")
        walk.outcome(
            f"table {table}",
            table,
            [],
            lambda vs, t=table: _pg_insert(pg_engine, t, vs),
            lambda t=table: _pg_read(pg_engine, t),
            ints,
        )
    assert {"table child", "table part"} <= set(walk.traversed)
    walk.report("PostgreSQL collations and table kinds")


def _pg_composite_ddl(table: str) -> list[str]:
    """``tc (k, g)`` with ``k`` as in ``table`` (type, collation, NOT NULL), keyed by (g, k)."""
    return [
        f"CREATE TABLE tc (LIKE {table})",
        "ALTER TABLE tc ADD COLUMN g int NOT NULL, ADD PRIMARY KEY (g, k)",
    ]


def _pg_insert(engine: sa.Engine, table: str, values: list[Any]) -> None:
    with engine.begin() as c:
        for v in values:
            c.exec_driver_sql(f"INSERT INTO {table} (k) VALUES (%(v)s)", {"v": v})


def _pg_read(engine: sa.Engine, table: str) -> list[Any]:
    with engine.connect() as c:
        return [r[0] for r in c.exec_driver_sql(f"SELECT k FROM {table} ORDER BY k")]


# --------------------------------------------------------------------------- MariaDB

_MY_EDGES: dict[str, list[Any]] = {
    "tinyint": [-128, 127, 0, -1],
    "smallint": [-32768, 32767, 0, -1],
    "mediumint": [-8388608, 8388607, 0, -1],
    "int": [-2147483648, 2147483647, 0, -1],
    "bigint": [-9223372036854775808, 9223372036854775807, 0, -1],
    "decimal": ["-9999999999", "9999999999", "0", "1"],
    "date": ["0001-01-01", "9999-12-31", "2000-02-29", "1000-01-01"],
    "datetime": ["0001-01-01 00:00:00", "9999-12-31 23:59:59", "2000-02-29 12:00:00"],
    "text": ["", " ", "a", "a ", "a\t", "\t", "b", "A", "é", "\U0001f600", "a  "],
}


def _my_composite_ddl(table: str) -> list[str]:
    """``tc (g, k)`` with ``k`` as in ``table`` (type, character set, collation, NOT NULL)."""
    return [
        f"CREATE TABLE tc AS SELECT * FROM {table} WHERE 1 = 0",
        "ALTER TABLE tc ADD COLUMN g int NOT NULL FIRST, ADD PRIMARY KEY (g, k)",
    ]


def _my_data_type_names(conn: sa.Connection) -> list[str]:
    """The type names MariaDB's help tables list under Data Types ('DEC, NUMERIC, FIXED' split)."""
    rows = conn.exec_driver_sql(
        "SELECT t.name FROM mysql.help_topic t JOIN mysql.help_category c "
        "ON c.help_category_id = t.help_category_id WHERE c.name = 'Data Types'"
    ).all()
    names: set[str] = set()
    for (raw,) in rows:
        for part in str(raw).replace("\\", "").split(","):
            part = re.sub(r"\s+Data Type$", "", part.strip())
            if re.fullmatch(r"[A-Z][A-Z0-9 ]*", part):
                names.add(part)
    return sorted(names)


def _my_read(engine: sa.Engine, table: str) -> list[Any]:
    with engine.connect() as c:
        return [r[0] for r in c.exec_driver_sql(f"SELECT k FROM {table} ORDER BY k")]


def _my_insert(engine: sa.Engine, table: str, values: list[Any]) -> None:
    with engine.begin() as c:  # SERIAL is AUTO_INCREMENT: a 0 must stay 0
        c.exec_driver_sql("SET SESSION sql_mode = CONCAT(@@sql_mode, ',NO_AUTO_VALUE_ON_ZERO')")
        for v in values:
            c.exec_driver_sql(f"INSERT INTO {table} (k) VALUES (%(v)s)", {"v": v})


def test_mariadb_catalog_walk(mariadb_db_url, redis_url, key_prefix):
    walk = Walk(mariadb_db_url, redis_url, key_prefix)
    engine = sa.create_engine(mariadb_db_url)
    with engine.connect() as c:
        names = _my_data_type_names(c)
    assert len(names) > 40, names  # the help tables are the catalog here
    created: dict[str, str] = {}
    for i, name in enumerate(names):
        table = f"t{i}"
        for ddl in (
            f"CREATE TABLE {table} (k {name} COLLATE utf8mb4_nopad_bin NOT NULL, UNIQUE KEY (k))",
            f"CREATE TABLE {table} (k {name}(16) COLLATE utf8mb4_nopad_bin NOT NULL, "
            "UNIQUE KEY (k))",
            f"CREATE TABLE {table} (k {name} NOT NULL, UNIQUE KEY (k))",
            f"CREATE TABLE {table} (k {name}(16) NOT NULL, UNIQUE KEY (k))",
            f"CREATE TABLE {table} (k {name}('paid', 'archived') NOT NULL, UNIQUE KEY (k))",
            f"CREATE TABLE {table} (k {name} NOT NULL)",
            f"CREATE TABLE {table} (k {name}(16) NOT NULL)",
        ):
            try:
                with engine.begin() as c:
                    c.exec_driver_sql(ddl)
                created[name] = table
                break
            except sa.exc.DBAPIError:
                continue
    assert {"UUID", "INT", "VARCHAR", "DATE", "ENUM"} <= set(created), created
    with engine.connect() as c:
        types = {
            r[0]: (r[1], r[2])
            for r in c.exec_driver_sql(
                "SELECT TABLE_NAME, DATA_TYPE, COLUMN_TYPE FROM information_schema.COLUMNS "
                "WHERE TABLE_SCHEMA = DATABASE() AND COLUMN_NAME = 'k'"
            )
        }
    same: dict[str, str] = {}  # COLUMN_TYPE -> the first name giving it (aliases: INT4 = INT)
    for name, table in created.items():
        data_type, column_type = types[table]
        first = same.setdefault(column_type, name)
        if first != name:  # an alias of a type already walked: the same column, same outcome
            (walk.traversed if first in walk.traversed else walk.refused)[name] = first
            continue
        edges = _MY_EDGES.get(data_type)
        bits = {"tinyint": 8, "smallint": 16, "mediumint": 24, "int": 32, "bigint": 64}
        if data_type in bits and "unsigned" in column_type:
            b = bits[data_type]
            edges = [0, 2**b - 1, 1, 2 ** (b - 1)]
        if data_type in ("varchar", "tinytext", "text", "mediumtext", "longtext"):
            edges = _MY_EDGES["text"]
        if edges is None:
            walk.refusal(name, table, [column_type])
            continue
        walk.outcome(
            name,
            table,
            [column_type],
            lambda vs, t=table: _my_insert(engine, t, vs),
            lambda t=table: _my_read(engine, t),
            edges,
        )
        walk.composite(name, _my_composite_ddl(table), edges)
    assert {"UUID", "ENUM", "SET", "CHAR", "BINARY", "FLOAT"} <= set(walk.refused)
    assert {"INT", "BIGINT", "DECIMAL", "DATE", "DATETIME"} <= set(walk.traversed)
    for name in ("DATE", "DATETIME"):  # zero dates are refused at plan time
        table = created[name]
        with engine.begin() as c:
            c.exec_driver_sql("SET SESSION sql_mode = ''")
            c.exec_driver_sql(f"INSERT INTO {table} (k) VALUES ('0000-00-00')")
        assert "zero date" in walk.refusal(f"{name} zero date", table, [])
        with engine.begin() as c:  # a zero month or day sorts between real dates
            c.exec_driver_sql("SET SESSION sql_mode = ''")
            c.exec_driver_sql(f"DELETE FROM {table} WHERE k < '0001-01-01'")
            c.exec_driver_sql(f"INSERT INTO {table} (k) VALUES ('2000-05-00')")
        assert "zero month or day" in walk.refusal(f"{name} zero day", table, [])
        with engine.begin() as c:
            c.exec_driver_sql("SET SESSION sql_mode = ''")
            c.exec_driver_sql(f"DELETE FROM {table} WHERE DAYOFMONTH(k) = 0")
            c.exec_driver_sql(f"INSERT INTO {table} (k) VALUES ('2000-00-15')")
        assert "zero month or day" in walk.refusal(f"{name} zero month", table, [])
    walk.report("MariaDB types")
    engine.dispose()


def test_mariadb_collations(mariadb_db_url, redis_url, key_prefix):
    walk = Walk(mariadb_db_url, redis_url, key_prefix)
    engine = sa.create_engine(mariadb_db_url)
    with engine.connect() as c:
        colls = [
            tuple(r)
            for r in c.exec_driver_sql(
                "SELECT COLLATION_NAME, CHARACTER_SET_NAME FROM information_schema.COLLATIONS "
                + ("" if LONG else "WHERE CHARACTER_SET_NAME IN ('utf8mb4', 'latin1', 'binary') ")
                + "ORDER BY 1"
            )
        ]
    for i, (coll, charset) in enumerate(colls):
        table = f"c{i}"
        try:
            with engine.begin() as c:
                c.exec_driver_sql(
                    f"CREATE TABLE {table} (k varchar(20) CHARACTER SET {charset} COLLATE {coll} "
                    "NOT NULL PRIMARY KEY)"
                )
        except sa.exc.DBAPIError:
            continue
        values = _MY_EDGES["text"] if charset.startswith("utf8mb4") else ["", "a", "a\t", "b", "A"]
        walk.outcome(
            coll,
            table,
            [],
            lambda vs, t=table: _my_insert(engine, t, vs),
            lambda t=table: _my_read(engine, t),
            values,
        )
        walk.composite(coll, _my_composite_ddl(table), values)
    assert "utf8mb4_nopad_bin" in walk.traversed
    assert "(g, utf8mb4_nopad_bin)" in walk.traversed
    assert {"utf8mb4_bin", "utf8mb4_general_ci", "utf8mb4_unicode_ci"} <= set(walk.refused)
    assert all(c in walk.refused[c] for c in walk.refused if "collation" in walk.refused[c])
    walk.report("MariaDB collations")
    engine.dispose()


# --------------------------------------------------------------------------- SQLite


def test_sqlite_affinities_strict_rowid_and_collations(tmp_path, redis_url, key_prefix):
    url = f"sqlite:///{tmp_path / 'm.db'}"
    walk = Walk(url, redis_url, key_prefix)
    engine = sa.create_engine(url)
    declared = sorted(set(sqlite_base.ischema_names) | {"", "INT8", "VARCHAR(10)"})
    forms: list[tuple[str, str]] = [
        (f"k {d} NOT NULL PRIMARY KEY", f"{d or '(none)'}") for d in declared
    ]
    forms += [
        (f"k {d} NOT NULL PRIMARY KEY) STRICT", f"STRICT {d}")
        for d in ("INT", "INTEGER", "REAL", "TEXT", "BLOB", "ANY")
    ]
    forms += [
        ("k INTEGER PRIMARY KEY", "rowid"),
        ("k BIGINT PRIMARY KEY", "BIGINT PRIMARY KEY without NOT NULL"),
        ("k INTEGER PRIMARY KEY DESC", "INTEGER PRIMARY KEY DESC"),
        ("k INTEGER PRIMARY KEY) WITHOUT ROWID", "INTEGER PRIMARY KEY WITHOUT ROWID"),
        ("k TEXT COLLATE NOCASE NOT NULL PRIMARY KEY", "NOCASE"),
        ("k TEXT COLLATE RTRIM NOT NULL PRIMARY KEY", "RTRIM"),
        ("k TEXT COLLATE BINARY NOT NULL PRIMARY KEY", "BINARY"),
    ]
    ints = [-(2**63), 2**63 - 1, 0, -1, 7]
    texts = ["", " ", "a", "a ", "a\t", "\t", "b", "A", "é", "\U0001f600", "a  "]
    for i, (ddl, entry) in enumerate(forms):
        table = f"t{i}"
        body = ddl if ddl.endswith(("STRICT", "ROWID")) else ddl + ")"
        with engine.begin() as c:
            c.exec_driver_sql(f"CREATE TABLE {table} ({body}")
        aff = entry.replace("STRICT ", "")
        values = (
            texts
            if any(s in aff.upper() for s in ("CHAR", "TEXT", "CLOB", "NOCASE", "RTRIM", "BINARY"))
            else ints
        )
        walk.outcome(
            entry,
            table,
            [],
            lambda vs, t=table: _sqlite_insert(engine, t, vs),
            lambda t=table: _my_read(engine, t),
            values,
        )
        walk.composite(entry, [_sqlite_composite_ddl(ddl)], values)
    assert {
        "rowid",
        "STRICT INTEGER",
        "BIGINT",
        "BINARY",
        "TEXT",
        "STRICT TEXT",
        "INTEGER PRIMARY KEY WITHOUT ROWID",
    } <= set(walk.traversed), walk.refused
    assert {
        "NOCASE",
        "RTRIM",
        "STRICT ANY",
        "REAL",
        "BLOB",
        "(none)",
        "DATETIME",
        "BIGINT PRIMARY KEY without NOT NULL",
        "INTEGER PRIMARY KEY DESC",
    } <= set(walk.refused), walk.traversed
    # a value of another storage class in a column of a table that is not STRICT
    for table, bad in (
        (f"t{declared.index('BIGINT')}", "zzz"),
        (f"t{declared.index('TEXT')}", b"\x00"),
    ):
        _sqlite_insert(engine, table, [bad])
        assert "storage class" in walk.refusal(f"{table} holding {bad!r}", table, [])
    walk.report("SQLite declared types")
    engine.dispose()


def _sqlite_composite_ddl(ddl: str) -> str:
    """``tc (g, k)`` with ``k`` declared as in ``ddl`` (NOT NULL), keyed by (g, k)."""
    col, rest = ddl, ""
    if ddl.endswith(("STRICT", "ROWID")):  # "k ... PRIMARY KEY) STRICT"
        col, _, rest = ddl.rpartition(")")
    col = col.replace(" PRIMARY KEY DESC", "").replace(" PRIMARY KEY", "")
    col += "" if "NOT NULL" in col else " NOT NULL"
    return f"CREATE TABLE tc (g INTEGER NOT NULL, {col}, PRIMARY KEY (g, k)){rest}"


def _sqlite_insert(engine: sa.Engine, table: str, values: list[Any]) -> None:
    with engine.begin() as c:
        for v in values:
            c.exec_driver_sql(f"INSERT INTO {table} (k) VALUES (?)", (v,))


# --------------------------------------------------------------------------- the docs


def test_every_rule_names_a_kind_the_codec_has_or_a_fix():
    kinds = {"int", "decimal", "text", "timestamp", "timestamptz", "date", "uuid"}
    for table in (
        key_types.POSTGRESQL,
        key_types.POSTGRESQL_KINDS,
        key_types.MYSQL,
        key_types.SQLITE,
    ):
        for name, r in table.items():
            assert (r.kind in kinds) if r.kind else r.fix, name
    assert sqlite3.sqlite_version_info >= (3, 37)  # STRICT tables and PRAGMA table_list
