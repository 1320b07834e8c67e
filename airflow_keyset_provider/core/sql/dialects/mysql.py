"""MySQL 8.0+ and MariaDB 10.6+ behind the ``Dialect`` interface (tested on MariaDB 10.11).

- uniqueness: a unique ``BTREE``/``HASH`` index or the primary key whose key parts are whole
  columns (no ``SUB_PART`` prefix, no functional key part), on NOT NULL columns; paging needs an
  ordered (``BTREE``) index starting with the key columns (``mysql_catalog.indexes``);
- key types: ``DATA_TYPE``'s rule in ``key_types`` (ENUM and SET sort by their ordinal, fixed-width
  CHAR is stored padded: ``'a\\t'`` sorts before ``'a'`` even under a NO PAD collation, MariaDB's
  UUID sorts by swapped segments, binary strings have no key encoding); zero dates and dates with
  a zero month or day in the leading column are refused at plan time (``check_key_values``); TIMESTAMP only when the session time zone is a fixed offset (its
  values are read in the session time zone, which a DST change makes ambiguous);
- text keys: only a NO PAD binary collation of UTF-8 (``utf8mb4_nopad_bin`` on MariaDB,
  ``utf8mb4_0900_bin`` on MySQL 8, and their utf8mb3 forms) orders like the key encoding. PAD
  SPACE collations, ``utf8mb4_bin`` included, compare ``'a' = 'a '`` and sort ``'a\\t'`` before
  ``'a'``; ``_ci``/``_ai``/language collations fold case, accents or sort by locale;
- chunk filter: on MariaDB the composite ``key > lo`` is written ``a > x OR (a = x AND b > y)``,
  which its optimizer turns into an index range (it scans the whole index for the row-value form
  ``(a, b) > (x, y)``); MySQL 8 ranges on the row-value form;
- commit order: ``AUTO_INCREMENT`` values are taken at insert and committed later, so after the
  bound is read the plan waits, bounded, for every InnoDB transaction of the server that was open
  then (``information_schema.INNODB_TRX``, which needs the PROCESS privilege). InnoDB serves that
  table from a copy it refreshes only after 0.1 s without any session reading it: each read
  checks, by a marker transaction of its own, that the copy is as of the read, and reads again
  (bounded by ``commit_wait_timeout``) until it is. Without the privilege, or for a table not
  stored in InnoDB, the plan is refused unless ``settle_seconds`` opts in;
- planner: ``EXPLAIN`` estimates (InnoDB index dives, no row read); quantiles of a key whose first
  column is an integer, date or datetime by bisecting that column's values on those estimates,
  with one index lookup per cut (``mysql_quantiles``); others by one exact ordered pass;
- preview: the chunk query's ``EXPLAIN`` rows (``explain_chunk``: access type ``range`` on an
  index without ``Using filesort`` is an index range scan, ``ALL`` a full scan);
- timeouts: ``max_statement_time`` (MariaDB) / ``max_execution_time`` (MySQL, SELECT only),
  ``innodb_lock_wait_timeout`` (row locks), ``lock_wait_timeout`` (metadata locks: a plan never
  waits a day behind an ``ALTER TABLE``), and READ COMMITTED (reads run in autocommit: no long snapshot,
  no gap locks);
- row errors: by MySQL error number.
"""

from __future__ import annotations

import datetime as dt
import logging
import math
import random
import time
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from sqlalchemy.dialects import mysql as sa_mysql

from ...errors import (
    CommitOrderTimeoutError,
    ConfigurationError,
    KeyValidationError,
    UnsupportedKeyTypeError,
)
from .. import commit_order, key_types, naming
from . import mysql_catalog, mysql_quantiles
from .base import Dialect, KeyTypeFound, RowErrorKind, ScanPlan, full_scan_problem

if TYPE_CHECKING:
    from ..catalog import IndexInfo
    from ..relation import Relation

log = logging.getLogger(__name__)

#: collations whose order is the code point order of the value, i.e. the key encoding's
CODE_POINT_COLLATIONS = frozenset(
    {"utf8mb4_nopad_bin", "utf8mb4_0900_bin", "utf8mb3_nopad_bin", "utf8_nopad_bin"}
)
_NO_PRIVILEGE = (1227, 1142, 1044)  # ER_SPECIFIC_ACCESS_DENIED, TABLEACCESS_DENIED, DBACCESS
_ROW_ERRNOS = frozenset(
    {1048, 1062, 1216, 1217, 1264, 1265, 1292, 1366, 1406, 1451, 1452, 1690, 3819, 4025}
)
_RETRY_ERRNOS = frozenset({1205, 1213, 1969, 3024, 2006, 2013, 1317, 1053})


def _errno(exc: BaseException) -> int | None:
    args = getattr(getattr(exc, "orig", exc), "args", ())
    return args[0] if args and isinstance(args[0], int) else None


_OPEN_TRX = (
    # Every InnoDB transaction of the server that may write (a session may write to any
    # database), and our own marker (``_fresh_rows``: ``mine``, ``fresh``).
    # Identity: thread and start time (a read-only transaction's trx_id changes when it writes).
    # trx_query is read only for our own thread (it is this statement); another's may hold a
    # row's data. INNODB_TRX is named once: one statement, one version of InnoDB's cache.
    "/* keyset-fresh {nonce} */ "
    "SELECT t.trx_id, t.trx_mysql_thread_id, t.trx_started, t.trx_state, "
    "       TIMESTAMPDIFF(SECOND, t.trx_started, NOW()), p.USER, p.HOST, p.DB, "
    "       t.trx_mysql_thread_id = CONNECTION_ID(), "
    "       t.trx_mysql_thread_id = CONNECTION_ID() AND LOCATE(:nonce, t.trx_query) > 0{extra} "
    "FROM information_schema.INNODB_TRX t "
    "LEFT JOIN information_schema.PROCESSLIST p ON p.ID = t.trx_mysql_thread_id "
    # a lone autocommit SELECT (no FOR UPDATE) or a READ ONLY transaction writes no key
    "WHERE t.trx_mysql_thread_id = CONNECTION_ID() "
    "OR (t.trx_autocommit_non_locking = 0 AND t.trx_is_read_only = 0)"
)
_NAMED_EXTRA = (
    # the connection's name (``naming``: PyMySQL's connection attribute program_name, else
    # mysqlclient's user variable @keyset_program_name) and whether it holds a metadata lock
    # stronger than a read's on the source (a write, or a locking read: both last until the
    # transaction ends)
    ", COALESCE((SELECT a.ATTR_VALUE FROM performance_schema.session_connect_attrs a "
    "   WHERE a.PROCESSLIST_ID = t.trx_mysql_thread_id AND a.ATTR_NAME = 'program_name' "
    "   LIMIT 1), "
    "  (SELECT CONVERT(v.VARIABLE_VALUE USING utf8mb4) "
    "   FROM performance_schema.user_variables_by_thread v "
    "   JOIN performance_schema.threads tv ON tv.THREAD_ID = v.THREAD_ID "
    "   WHERE tv.PROCESSLIST_ID = t.trx_mysql_thread_id "
    f"  AND v.VARIABLE_NAME = '{naming.VARIABLE}' LIMIT 1)), "
    "EXISTS (SELECT 1 FROM performance_schema.metadata_locks m "
    "   JOIN performance_schema.threads th ON th.THREAD_ID = m.OWNER_THREAD_ID "
    "   WHERE th.PROCESSLIST_ID = t.trx_mysql_thread_id AND m.OBJECT_TYPE = 'TABLE' "
    "   AND m.OBJECT_SCHEMA = COALESCE(:schema, DATABASE()) AND m.OBJECT_NAME = :tbl "
    "   AND m.LOCK_TYPE NOT IN ('SHARED', 'SHARED_HIGH_PRIO', 'SHARED_READ'))"
)
#: InnoDB refreshes the rows of INNODB_TRX only when nobody read them for 0.1 s
#: (``CACHE_MIN_IDLE_TIME`` in trx0i_s.cc; every read restarts that clock, any session's): a
#: retry of a stale read waits longer than that, with jitter so two pollers fall out of step
FRESH_RETRY = (0.11, 0.2)
#: how long ``open_transactions`` tries for a fresh read by default (``settle`` passes its own)
FRESH_TIMEOUT = 60.0

#: the performance schema records metadata locks (off by default on MariaDB: then a worker's
#: writes cannot be told, and every transaction is waited for)
_MDL_RECORDED = sa.text(
    "SELECT @@performance_schema AND EXISTS (SELECT 1 FROM performance_schema.setup_instruments "
    "WHERE NAME = 'wait/lock/metadata/sql/mdl' AND ENABLED = 'YES')"
)
_AUTO_INCREMENT = sa.text(
    "SELECT EXTRA FROM information_schema.COLUMNS WHERE TABLE_SCHEMA = COALESCE(:schema, DATABASE()) "
    "AND TABLE_NAME = :tbl AND COLUMN_NAME = :col"
)


def _fresh_rows(conn: sa.Connection, watch: tuple[str | None, str] | None) -> list[Any] | None:
    """One read of ``_OPEN_TRX`` as of now, or None if InnoDB served an older copy.

    InnoDB answers INNODB_TRX from a cache it refills only after 0.1 s without a read, so a
    read can show the transactions of some time ago and miss one that took a key since (a plan
    would then not wait for it). Our connection (``conn``, autocommit) opens a marker
    transaction, then reads with a fresh nonce in the statement: the copy is as of this
    statement iff our marker's row shows this statement's text (``trx_query``)."""
    nonce = uuid.uuid4().hex
    extra = "" if watch is None else _NAMED_EXTRA
    stmt = sa.text(_OPEN_TRX.format(nonce=nonce, extra=extra))
    params: dict[str, Any] = {"nonce": nonce}
    if watch is not None:
        params.update(schema=watch[0], tbl=watch[1])
    conn.exec_driver_sql("START TRANSACTION WITH CONSISTENT SNAPSHOT")
    try:
        rows = list(conn.execute(stmt, params))
    finally:
        conn.exec_driver_sql("ROLLBACK")
    fresh = any(r[8] and r[9] for r in rows)
    return [r for r in rows if not r[8]] if fresh else None


def open_transactions(
    conn: sa.Connection,
    watch: tuple[str | None, str] | None = None,
    *,
    timeout: float = FRESH_TIMEOUT,
) -> dict[str, commit_order.Blocker]:
    """InnoDB transactions open now, by identity (see ``_OPEN_TRX``), as of this call: a copy
    InnoDB served from before it is read again (``_fresh_rows``), for up to ``timeout`` s, then
    ``CommitOrderTimeoutError``. ``conn`` must be in autocommit. ``watch`` (schema or None for
    the connection's database, table): also read each one's name (``program_name``, or
    ``@keyset_program_name`` for mysqlclient; ``naming``) and whether it
    holds a write lock on that table (``performance_schema``; check ``_MDL_RECORDED`` first)."""
    deadline = time.monotonic() + timeout
    tries = 0
    while (rows := _fresh_rows(conn, watch)) is None:
        tries += 1
        if time.monotonic() >= deadline:
            raise CommitOrderTimeoutError(
                f"information_schema.INNODB_TRX could not be read as of now in {timeout:.0f} s "
                f"({tries} tries): InnoDB refreshes it only after 0.1 s in which no session read "
                "it, and other sessions read it more often than that. No round was saved (an "
                "old copy could miss a transaction holding a key). Poll INNODB_TRX less often "
                "elsewhere, or raise commit_wait_timeout."
            )
        time.sleep(random.uniform(*FRESH_RETRY))
    out = {}
    for row in rows:
        trx_id, thread, started, state, age, user, host, db = row[:8]
        app, writes = (row[10], row[11]) if watch is not None else ("", True)
        if isinstance(app, bytes):
            app = app.decode("ascii", "replace")
        ident = f"{thread}@{started}" if thread else f"trx:{trx_id}"
        named = f" program_name {app!r}" if watch is not None else ""
        out[ident] = commit_order.Blocker(
            ident,
            f"thread {thread} user {user} host {host}{named} database {db} transaction {trx_id} "
            f"open for {int(age or 0)} s ({state}{', writing the source' if writes and watch else ''}"
            f"; end it with KILL {thread})",
            app or "",
            bool(writes),
        )
    return out


class MysqlDialect(Dialect):
    name = "mysql"
    row_estimate = "explain"
    primary_key_is_ordered = False  # a MEMORY table's primary key is a HASH index
    # Both drivers build a chunk's rows when the query runs (nothing left to defer), and
    # mysqlclient's cursor.close() reads the connection (next_result): closing a held chunk while
    # the prefetch thread queries failed with "connection is already in use from another thread".
    lazy_chunks = False

    def __init__(self, sa_dialect: sa.Dialect) -> None:
        self.sa_dialect = sa_dialect
        self.can_wait = False  # set by check_commit_order: INNODB_TRX is readable for this table

    @property
    def is_mariadb(self) -> bool:
        return bool(getattr(self.sa_dialect, "is_mariadb", False))

    def _fix_collation(self) -> str:
        return "utf8mb4_nopad_bin" if self.is_mariadb else "utf8mb4_0900_bin"

    # ---- key validation ---------------------------------------------------------------------
    def unique_indexes(self, conn: sa.Connection, src: Relation) -> list[IndexInfo]:
        return mysql_catalog.indexes(conn, src.schema, src.table_name)

    def not_null_fix(self, src: Relation, col: sa.Column) -> str:
        ddl = col.type.compile(dialect=self.sa_dialect)
        return f"ALTER TABLE {src.qualified_name} MODIFY {col.name} {ddl} NOT NULL"

    def key_types(
        self, conn: sa.Connection, src: Relation, columns: Sequence[str]
    ) -> dict[str, KeyTypeFound]:
        """``information_schema.COLUMNS.DATA_TYPE``'s rule in ``key_types``."""
        fix = (("collation", self._fix_collation()),)
        return {
            c: KeyTypeFound(label, key_types.rule("mysql", data_type), fix)
            for c, data_type, label in mysql_catalog.column_types(
                conn, src.schema, src.table_name, list(columns)
            )
        }

    def check_key_values(self, src: Relation, conn: sa.Connection) -> None:
        """The leading key column of a date/time kind holds no date Python cannot: below
        0001-01-01 (zero dates, legal under the default ``sql_mode``, sort there), nor with a zero
        month or day (``'2022-00-00'``, ``'2022-05-00'``), which sort between the last instant of
        the previous month and the first of the month: per year that holds keys, one query over
        the twelve gaps (index ranges) and one lookup of the next year."""
        kind = src.key_kinds[0]
        if kind not in ("date", "timestamp"):
            return
        name = src.key_names[0]
        col = src.engine.dialect.identifier_preparer.quote(name)
        fix = (
            "UPDATE those rows or exclude them with where=..., and add NO_ZERO_DATE,"
            "NO_ZERO_IN_DATE to the server's sql_mode"
        )
        if src.probe(conn, f"{col} < :lo", {"lo": "0001-01-01"}) is not None:
            raise UnsupportedKeyTypeError(
                f"key column {name!r} of {src.qualified_name!r} holds a zero date ('0000-00-00') or "
                "a date in year 0, which Python cannot hold: the key encoding has no place for it, "
                f"so its rows could never be delivered. Fix: {fix} (WHERE {name} < '0001-01-01')."
            )
        suffix = "" if kind == "date" else " 23:59:59.999999"
        next_year = sa.text(f"SELECT YEAR(MIN({col})) FROM {src.rel} WHERE {col} > :after")
        year = conn.execute(sa.text(f"SELECT YEAR(MIN({col})) FROM {src.rel}")).scalar()
        while year is not None:  # one pass per year holding keys: two index lookups each
            self._zero_in_date(src, conn, col, name, int(year), suffix, fix)
            year = conn.execute(next_year, {"after": f"{int(year):04d}-12-31{suffix}"}).scalar()

    @staticmethod
    def _zero_in_date(
        src: Relation, conn: sa.Connection, col: str, name: str, year: int, suffix: str, fix: str
    ) -> None:
        gaps: list[str] = []
        params: dict[str, str] = {}
        for month in range(1, 13):
            if (year, month) == (1, 1):  # '0001-00-..' sorts below 0001-01-01: probed above
                continue
            prev = dt.date(year, month, 1) - dt.timedelta(days=1)
            i = len(gaps)
            params[f"a{i}"], params[f"b{i}"] = (
                prev.isoformat() + suffix,
                f"{year:04d}-{month:02d}-01",
            )
            gaps.append(f"({col} > :a{i} AND {col} < :b{i})")
        if src.probe(conn, " OR ".join(gaps), params) is not None:
            raise UnsupportedKeyTypeError(
                f"key column {name!r} of {src.qualified_name!r} holds a date with a zero month or "
                "day ('2022-00-00', '2022-05-00'), which Python cannot hold: the key encoding has "
                f"no place for it, so its rows could never be delivered. Fix: {fix} (WHERE "
                f"MONTH({name}) = 0 OR DAYOFMONTH({name}) = 0)."
            )

    def check_key_column(self, src: Relation, col: sa.Column) -> None:
        """A TIMESTAMP key needs a fixed-offset session time zone."""
        t = col.type
        where = f"key column {col.name!r} of {src.qualified_name!r}"
        if isinstance(t, sa_mysql.TIMESTAMP):
            with src.engine.connect() as conn:
                zone = str(conn.exec_driver_sql("SELECT @@session.time_zone").scalar())
            if not (zone[:1] in "+-" and ":" in zone):
                raise UnsupportedKeyTypeError(
                    f"{where} is TIMESTAMP, read in the session time zone {zone!r}; a zone with "
                    "daylight saving time repeats an hour of local times, so the keys read would "
                    "not keep the stored order. Fix: give the source a fixed-offset session zone "
                    "(URL ?init_command=SET time_zone='%2B00:00'), or key by a DATETIME column."
                )

    def check_collation(self, src: Relation, key_cols: Sequence[sa.Column]) -> None:
        text = [c.name for c in key_cols]
        if not text:
            return
        with src.engine.connect() as conn:
            found = mysql_catalog.text_columns(conn, src.schema, src.table_name, text)
        for c in found:
            if (c.collation or "") in CODE_POINT_COLLATIONS:
                continue
            why = (
                "PAD SPACE ('a' = 'a ', and 'a\\t' sorts before 'a')"
                if (c.collation or "").endswith("_bin")
                else "case-, accent- or locale-aware, and PAD SPACE"
            )
            raise KeyValidationError(
                f"text key column {c.column!r} of {src.qualified_name!r} uses collation "
                f"{c.collation!r}, which does not order by code point ({why}), so cursors compared "
                f"in Redis would disagree with the database. Fix: ALTER TABLE {src.qualified_name} "
                f"MODIFY {c.column} {c.data_type.upper()}(...) CHARACTER SET utf8mb4 COLLATE "
                f"{self._fix_collation()} NOT NULL (or page by another key)."
            )

    # ---- the chunk filter -------------------------------------------------------------------
    def key_after(self, cols: Sequence[Any], params: Sequence[Any]) -> Any:
        if len(cols) == 1 or not self.is_mariadb:
            return super().key_after(cols, params)
        return _expanded(cols, params, strict=True)

    def key_at_most(self, cols: Sequence[Any], params: Sequence[Any]) -> Any:
        if len(cols) == 1 or not self.is_mariadb:
            return super().key_at_most(cols, params)
        return _expanded(cols, params, strict=False)

    # ---- commit order -----------------------------------------------------------------------
    def check_commit_order(self, src: Relation, conn: sa.Connection) -> None:
        """Refuse a table whose in-flight writes cannot be listed: not InnoDB, or no PROCESS
        privilege to read ``INNODB_TRX``; ``settle_seconds > 0`` opts in to a window instead."""
        self.can_wait = False
        engine = mysql_catalog.table_engine(conn, src.schema, src.table_name)
        problem = ""
        if engine.upper() != "INNODB":
            problem = (
                f"{src.qualified_name!r} is stored in {engine or 'an unknown engine'}, not InnoDB, "
                "whose open transactions are the only ones information_schema.INNODB_TRX lists. Fix: "
                f"ALTER TABLE {src.qualified_name} ENGINE=InnoDB"
            )
        else:
            try:
                # the privilege probe reads INNODB_METRICS (PROCESS, like INNODB_TRX): a read of
                # INNODB_TRX here would keep its cache stale for the wait right after
                conn.execute(
                    sa.text("SELECT COUNT(*) FROM information_schema.INNODB_METRICS")
                ).scalar()
            except sa.exc.DBAPIError as exc:
                if _errno(exc) not in _NO_PRIVILEGE:
                    raise
                problem = (
                    "the source's user lacks the PROCESS privilege, so information_schema.INNODB_TRX "
                    "(the transactions that may still commit an AUTO_INCREMENT key below the round's "
                    "end) cannot be read. Fix: GRANT PROCESS ON *.* TO the source's user"
                )
        if not problem:
            self.can_wait = True
            return
        if src.settle_seconds <= 0:
            raise ConfigurationError(
                f"{problem}, or opt in to a settle window with settle_seconds > 0 (keys committed "
                "later than that window are missed)."
            )
        log.warning(
            "%s: cannot wait for open transactions; only the settle window of %.1f s protects "
            "late keys",
            src.qualified_name,
            src.settle_seconds,
        )

    def settle(self, src: Relation, conn: sa.Connection) -> None:
        if not self.can_wait:
            super().settle(src, conn)
            return
        skip, watch = self._other_streams_skip(src, conn)

        def list_open(c: sa.Connection) -> dict[str, commit_order.Blocker]:
            # the module's function looked up at each call (a benchmark narrows it)
            wait = src.commit_wait_timeout
            return (
                open_transactions(c, watch, timeout=wait)
                if watch
                else open_transactions(c, timeout=wait)
            )

        commit_order.settle(
            conn,
            src.commit_wait_timeout,
            src.settle_seconds,
            src.qualified_name,
            list_open,
            skip,
        )

    def _other_streams_skip(
        self, src: Relation, conn: sa.Connection
    ) -> tuple[Any, tuple[str | None, str] | None]:
        """Skip the provider's workers of other streams that do not write the source (see
        ``commit_order``) when the first key column is ``AUTO_INCREMENT`` (its value is taken
        when the row is written) and the performance schema shows connection names and
        metadata locks; else wait for every transaction (None, None)."""
        name = src.connection_name
        if name is None:
            return None, None
        where = {"schema": src.schema, "tbl": src.table_name}
        extra = conn.execute(_AUTO_INCREMENT, {**where, "col": src.key_names[0]}).scalar()
        if "auto_increment" not in str(extra or "").lower():
            return None, None
        try:
            recorded = bool(conn.execute(_MDL_RECORDED).scalar())
        except sa.exc.DBAPIError as exc:
            if _errno(exc) not in _NO_PRIVILEGE:
                raise
            recorded = False  # no SELECT on performance_schema
        if not recorded:
            return None, None
        return commit_order.other_streams_reader(name.prefix), (src.schema, src.table_name)

    def row_width(self, src: Relation, conn: sa.Connection) -> float | None:
        """``AVG_ROW_LENGTH`` of the table (InnoDB: data length / estimated rows, all columns:
        an estimate from above of the read columns); None for an empty or unknown table."""
        width = mysql_catalog.table_figure(conn, src.schema, src.table_name, "AVG_ROW_LENGTH")
        return width or None

    # ---- the planner ------------------------------------------------------------------------
    def estimate_rows(
        self, src: Relation, conn: sa.Connection, stmt: sa.Select, params: dict[str, Any]
    ) -> int:
        index = mysql_quantiles.key_index(src, conn)
        return mysql_quantiles.explain_rows(src, conn, stmt, params, index)

    def sampled_cuts(
        self,
        src: Relation,
        conn: sa.Connection,
        lo: str,
        params: dict[str, Any],
        est: int,
        parts: int,
        sample_rows: int,
    ) -> list[str] | None:
        return mysql_quantiles.bisected_cuts(src, conn, lo, params, est, parts)

    def explain_chunk(
        self, src: Relation, conn: sa.Connection, stmt: sa.Select, params: dict[str, Any]
    ) -> ScanPlan:
        """The chunk query's ``EXPLAIN``: access type ``range`` (or ``ref``/``eq_ref``/``const``)
        on an index without ``Using filesort`` is an index range scan; ``index`` reads the index
        in key order and stops after ``n`` rows (accepted); ``ALL`` or a filesort read the table
        or the whole range first."""
        sql, params_for = src.driver_call(stmt)
        args = params_for(params)
        args = tuple(args) if isinstance(args, list) else args
        rows = [dict(r) for r in conn.exec_driver_sql("EXPLAIN " + sql, args).mappings()]
        lines = tuple(
            f"{r.get('table')}: type={r.get('type')} key={r.get('key')} rows={r.get('rows')}"
            + (f" ({r.get('Extra')})" if r.get("Extra") else "")
            for r in rows
        )
        if not rows:
            return ScanPlan("unknown", None, lines, "EXPLAIN returned no row")
        first = rows[0]
        access, index = str(first.get("type") or ""), first.get("key")
        extra = str(first.get("Extra") or "")
        if access == "ALL":
            return ScanPlan(
                "full scan", None, lines, full_scan_problem(src, "is a full table scan (type ALL)")
            )
        if "filesort" in extra.lower():
            return ScanPlan(
                "full scan",
                index,
                lines,
                full_scan_problem(src, "sorts the rows it reads (Using filesort)"),
            )
        if index and access in ("range", "ref", "eq_ref", "const", "index"):
            return ScanPlan("index range", str(index), lines)
        return ScanPlan("unknown", index, lines, "the plan reads no index range (see the plan)")

    # ---- timeouts ---------------------------------------------------------------------------
    def session_statements(self, statement_s: float, lock_s: float) -> list[str]:
        out = [
            "SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED",
            f"SET SESSION innodb_lock_wait_timeout = {max(1, math.ceil(lock_s))}",
            # metadata locks (ALTER TABLE, LOCK TABLES ... WRITE): the server's default is a day
            f"SET SESSION lock_wait_timeout = {max(1, math.ceil(lock_s))}",
        ]
        if self.is_mariadb:
            out.append(f"SET SESSION max_statement_time = {float(statement_s)}")
        else:  # MySQL 8: SELECT statements only (from MySQL's documentation; not tested here)
            out.append(f"SET SESSION max_execution_time = {int(statement_s * 1000)}")
        return out

    # ---- write-back -------------------------------------------------------------------------
    def classify_row_error(self, exc: BaseException) -> RowErrorKind | None:
        code = _errno(exc)
        if code in _ROW_ERRNOS:
            return "row"
        if code in _RETRY_ERRNOS:
            return "retry"
        return super().classify_row_error(exc)


def _expanded(cols: Sequence[Any], params: Sequence[Any], strict: bool) -> Any:
    """``(a, b, c) > (x, y, z)`` as ``a > x OR (a = x AND (b > y OR (b = y AND c > z)))`` (``<=``
    with ``strict=False``): the form MariaDB's range optimizer turns into an index range."""
    last = cols[-1] > params[-1] if strict else cols[-1] <= params[-1]
    expr = last
    for c, p in zip(reversed(cols[:-1]), reversed(params[:-1]), strict=True):
        expr = sa.or_(c > p if strict else c < p, sa.and_(c == p, expr))
    return expr
