"""A SQL table read in key order: validation, the round's upper bound, keyset chunks.

Guarantees:

- ``validate`` refuses a key that does not define a stable total order (missing, nullable, not
  covered by a primary key / unique constraint / unique index, no index to page by, a type whose
  order cannot be encoded exactly, a text column whose collation is not byte order) with an error
  that names the column and the fix. It reads the catalog only.
- ``upper_bound`` on PostgreSQL returns a bound such that every key ``<= bound`` that will ever
  commit has committed (or aborted) when it returns: it waits, bounded, for the transactions that
  were open when ``max(key)`` was read. Other sources wait ``settle_seconds`` (SQLite serialises
  writers, so it needs none).
- ``fetch`` returns the rows with ``lo < key <= hi`` in key order, at most ``n`` of them, with one
  round trip, using row-value comparison (an index range scan on PostgreSQL).
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from .errors import (
    CommitOrderTimeoutError,
    ConfigurationError,
    KeyValidationError,
    UnsupportedKeyTypeError,
)
from .keys import MIN_KEY, decode_key, encode_key

log = logging.getLogger(__name__)

# collations that compare by code point (= UTF-8 byte order), as the encoded keys do; PostgreSQL
# 17+ built-in pg_c_utf8 and 18+ pg_unicode_fast sort by code point too
_BYTE_ORDER_COLLATIONS = {"C", "POSIX", "C.UTF-8", "C.utf8", "ucs_basic", "pg_c_utf8", "pg_unicode_fast"}


class FetchedRows(Sequence[tuple]):
    """One chunk's rows, still in the driver's result buffer (C memory, one chunk). Its length and
    last row are known at once; the rows become Python objects only when something reads them, so
    a processor that needs only the count (or a prefetch that overlaps it) pays nothing for them."""

    __slots__ = ("_convert", "_cur", "_last", "_n", "_rows")

    def __init__(self, cur: Any, n: int, last: tuple, convert: Callable[[list], list[tuple]]) -> None:
        self._cur, self._n, self._last, self._convert = cur, n, last, convert
        self._rows: list[tuple] | None = None

    def __len__(self) -> int:
        return self._n

    def materialize(self) -> list[tuple]:
        if self._rows is None:
            self._rows = self._convert(self._cur.fetchall())
            self.close()
        return self._rows

    def __getitem__(self, i: Any) -> Any:
        if self._rows is None and isinstance(i, int) and i in (-1, self._n - 1):
            return self._last
        return self.materialize()[i]

    def __iter__(self) -> Iterator[tuple]:
        return iter(self.materialize())

    def close(self) -> None:
        """Free the driver's buffer (rows not materialized yet are gone)."""
        if self._cur is not None:
            self._cur.close()
            self._cur = None


def materialize(rows: Sequence[tuple]) -> list[tuple]:
    return rows.materialize() if isinstance(rows, FetchedRows) else list(rows)


def release(rows: Sequence[tuple] | None) -> None:
    if isinstance(rows, FetchedRows):
        rows.close()


def make_engine(url: str | Engine) -> Engine:
    """An autocommit engine: a traversal never holds a transaction (and so a snapshot) open
    between chunks. A bare ``postgresql://`` URL gets SQLAlchemy's default driver (psycopg 3 with
    SQLAlchemy 2.1); ``postgresql+psycopg2://`` selects psycopg2. Both work."""
    if isinstance(url, Engine):
        return url.execution_options(isolation_level="AUTOCOMMIT")
    try:
        return sa.create_engine(url, isolation_level="AUTOCOMMIT", pool_pre_ping=True)
    except (sa.exc.ArgumentError, sa.exc.NoSuchModuleError) as exc:
        raise ConfigurationError(f"source URL is not usable: {exc}") from exc


def _key_kind(col: sa.Column) -> str:
    t = col.type
    if isinstance(t, (sa.Float, sa.Boolean)):
        raise UnsupportedKeyTypeError(
            f"key column {col.name!r} has type {t}, whose values are not exact or not unique "
            "enough to order by. Use an integer, text, timestamp, date, UUID or numeric column."
        )
    if isinstance(t, sa.DateTime):
        return "timestamptz" if t.timezone else "timestamp"
    for cls, kind in ((sa.Integer, "int"), (sa.Numeric, "decimal"),
                      (sa.Date, "date"), (sa.Uuid, "uuid"), (sa.String, "text")):
        if isinstance(t, cls):
            return kind
    raise UnsupportedKeyTypeError(
        f"key column {col.name!r} has type {t}, which has no exact order-preserving encoding. "
        "Supported: integer, text/varchar, timestamp(tz), date, uuid, numeric."
    )


class SqlSource:
    """One table (optionally ``schema.table``), keyed by one or more columns."""

    def __init__(
        self,
        url: str | Engine,
        table: str,
        key: str | Sequence[str],
        *,
        where: str | None = None,
        columns: Sequence[str] | None = None,
        settle_seconds: float = 0.0,
        commit_wait_timeout: float = 60.0,
        retention_sql: str | None = None,
    ) -> None:
        if not isinstance(table, str) or not table.strip():
            raise ConfigurationError("table must be a non-empty table name, e.g. 'events' or 'app.events'")
        keys = [key] if isinstance(key, str) else list(key) if isinstance(key, (list, tuple)) else []
        if not keys or not all(isinstance(k, str) and k for k in keys):
            raise ConfigurationError(f"key must be a column name or a list of column names, got {key!r}")
        if len(set(keys)) != len(keys):
            raise ConfigurationError(f"key lists a column twice: {keys}")
        if columns is not None and (isinstance(columns, str) or not all(isinstance(c, str) for c in columns)):
            raise ConfigurationError(f"columns must be a list of column names, got {columns!r}")
        self._owns_engine = not isinstance(url, Engine)  # never dispose a caller's engine
        self.engine = make_engine(url)
        self.dialect = self.engine.dialect.name
        schema, _, name = table.rpartition(".")
        self.schema, self.table_name = schema or None, name
        self.key_names = keys
        self.arity = len(keys)
        self.where = where
        self.column_names = list(dict.fromkeys([*keys, *(columns or [])]))
        self.settle_seconds = settle_seconds
        self.commit_wait_timeout = commit_wait_timeout
        self.retention_sql = retention_sql
        self._table: sa.Table | None = None
        self._fetchers: dict[bool, Callable[[str, str, int], Sequence[tuple]]] = {}
        self._raw: Any = None  # the DBAPI connection of the hot path, owned by this source

    # ---- validation --------------------------------------------------------------------------
    @property
    def qualified_name(self) -> str:
        return f"{self.schema}.{self.table_name}" if self.schema else self.table_name

    def fingerprint(self) -> str:
        """What identifies the traversed set; stored with a round."""
        return json.dumps({"table": self.qualified_name, "key": self.key_names, "where": self.where,
                           "dialect": self.dialect}, sort_keys=True)

    @property
    def table(self) -> sa.Table:
        if self._table is None:
            self.validate()
        assert self._table is not None
        return self._table

    def ensure_validated(self) -> None:
        """Validate once per source object (``validate`` reads the catalog every time)."""
        if self._table is None:
            self.validate()

    def validate(self) -> None:
        """Refuse a key that does not give a stable total order. Reads the catalog only."""
        insp = sa.inspect(self.engine)
        if not insp.has_table(self.table_name, schema=self.schema):
            raise KeyValidationError(
                f"table {self.qualified_name!r} does not exist (dialect {self.dialect}). Check the "
                "name and schema ('schema.table'), and that the connection points at the right database."
            )
        table = sa.Table(self.table_name, sa.MetaData(), schema=self.schema, autoload_with=self.engine)
        missing = [c for c in self.column_names if c not in table.c]
        if missing:
            raise KeyValidationError(
                f"column {missing[0]!r} does not exist in {self.qualified_name!r}; its columns are "
                f"{sorted(table.c.keys())}"
            )
        key_cols = [table.c[k] for k in self.key_names]
        pk_cols = list(table.primary_key.columns)
        for col in key_cols:
            # SQLite's INTEGER PRIMARY KEY aliases the rowid and can never be NULL, though it
            # reflects as nullable; any other SQLite primary key column does accept NULL.
            rowid_alias = self.dialect == "sqlite" and pk_cols == [col] and isinstance(col.type, sa.Integer)
            if col.nullable and not rowid_alias:
                raise KeyValidationError(
                    f"key column {col.name!r} of {self.qualified_name!r} is nullable: NULL keys have no "
                    f"place in the order and would be skipped. Fix: ALTER TABLE {self.qualified_name} "
                    f"ALTER COLUMN {col.name} SET NOT NULL (after filling NULLs)."
                )
            _key_kind(col)
        keyset = set(self.key_names)
        pk = [c.name for c in table.primary_key.columns]
        unique_sets = [set(pk)] if pk else []
        ordered_prefixes = [pk] if pk else []
        for uc in insp.get_unique_constraints(self.table_name, schema=self.schema):
            unique_sets.append(set(uc["column_names"]))
            ordered_prefixes.append(list(uc["column_names"]))
        for ix in insp.get_indexes(self.table_name, schema=self.schema):
            cols = [c for c in ix["column_names"] if c is not None]
            if ix.get("unique") and len(cols) == len(ix["column_names"]):
                unique_sets.append(set(cols))
            ordered_prefixes.append(cols)
        if not any(s and s <= keyset for s in unique_sets):
            listed = ", ".join(self.key_names)
            raise KeyValidationError(
                f"key ({listed}) of {self.qualified_name!r} is not unique: no primary key, unique "
                "constraint or unique index covers it, so two rows could share a cursor position and "
                f"one would be skipped. Fix: CREATE UNIQUE INDEX ON {self.qualified_name} ({listed}), or "
                "add the primary key as the last key column, e.g. key=['created_at', 'id']."
            )
        if not any(p[: self.arity] == self.key_names for p in ordered_prefixes):
            listed = ", ".join(self.key_names)
            raise KeyValidationError(
                f"no index of {self.qualified_name!r} starts with the key columns ({listed}) in that "
                f"order; every chunk would scan the table. Fix: CREATE INDEX ON {self.qualified_name} ({listed})."
            )
        if self.dialect == "postgresql":
            self._check_collation(key_cols)
        self._table = table
        self.key_kinds = [_key_kind(c) for c in key_cols]

    def _check_collation(self, key_cols: Sequence[sa.Column]) -> None:
        text_cols = [c.name for c in key_cols if isinstance(c.type, sa.String)]
        if not text_cols:
            return
        sql = sa.text(
            "SELECT a.attname, CASE WHEN co.collname = 'default' THEN d.datcollate ELSE co.collname END "
            "FROM pg_attribute a JOIN pg_collation co ON co.oid = a.attcollation "
            "JOIN pg_database d ON d.datname = current_database() "
            "WHERE a.attrelid = CAST(:rel AS regclass) AND a.attname = ANY(:cols)"
        )
        quote = self.engine.dialect.identifier_preparer.quote
        rel_name = (quote(self.schema) + "." if self.schema else "") + quote(self.table_name)
        with self.engine.connect() as conn:
            for name, coll in conn.execute(sql, {"rel": rel_name, "cols": text_cols}):
                if coll not in _BYTE_ORDER_COLLATIONS:
                    raise KeyValidationError(
                        f"text key column {name!r} uses collation {coll!r}, which does not order by "
                        "code point, so cursors compared in Redis would disagree with the database. Fix: "
                        f'ALTER TABLE {self.qualified_name} ALTER COLUMN {name} TYPE text COLLATE "C" '
                        "(or page by another key)."
                    )

    # ---- encoding ----------------------------------------------------------------------------
    def encode(self, key_values: Sequence[Any]) -> str:
        return encode_key(key_values)

    def _key_params(self, encoded: str, prefix: str) -> dict[str, Any]:
        values = decode_key(encoded)
        return {f"{prefix}{i}": v for i, v in enumerate(values)}

    def _key_expr(self, on: Any = None) -> Any:
        t = self.table if on is None else on
        cols = [t.c[k] for k in self.key_names]
        return cols[0] if self.arity == 1 else sa.tuple_(*cols)

    def _param_expr(self, prefix: str) -> Any:
        cols = [self.table.c[k] for k in self.key_names]
        params = [sa.bindparam(f"{prefix}{i}", type_=c.type) for i, c in enumerate(cols)]
        return params[0] if self.arity == 1 else sa.tuple_(*params)

    def _range_filter(self, has_lo: bool, on: Any = None) -> list[Any]:
        """``lo < key <= hi [AND where]`` as row-value comparisons, on the table or a sample of it."""
        k = self._key_expr(on)
        conds = [k <= self._param_expr("h")]
        if has_lo:
            conds.insert(0, k > self._param_expr("c"))
        if self.where:
            conds.append(sa.text(f"({self.where})"))
        return conds

    def _chunk_statement(self, has_lo: bool) -> sa.Select:
        cols = [self.table.c[c] for c in self.column_names]
        return (
            sa.select(*cols)
            .where(*self._range_filter(has_lo))
            .order_by(*[self.table.c[k] for k in self.key_names])
            .limit(sa.bindparam("n", type_=sa.Integer()))
        )

    # ---- reading -----------------------------------------------------------------------------
    def key_of(self) -> Callable[[tuple], Any]:
        """Row tuple -> user-facing key (scalar or tuple)."""
        arity = self.arity
        return (lambda row: row[0]) if arity == 1 else (lambda row: tuple(row[:arity]))

    def fetch(self, lo: str, hi: str, n: int) -> Sequence[tuple]:
        """Rows with ``lo < key <= hi`` in key order, at most ``n``: one round trip. The result may
        be a ``FetchedRows`` (lazy); ``materialize`` it to get a list, ``release`` it when done."""
        has_lo = lo != MIN_KEY
        fetcher = self._fetchers.get(has_lo)
        if fetcher is None:
            fetcher = self._fetchers[has_lo] = self._compile_fetcher(has_lo)
        return fetcher(lo, hi, n)

    def _driver_call(self, stmt: Any) -> tuple[str, Callable[[dict[str, Any]], Any]]:
        """Compile ``stmt`` once for this dialect: the SQL string and a function turning a dict of
        bound values into what the DBAPI cursor takes, converted by SQLAlchemy's bind processors."""
        dialect = self.engine.dialect
        compiled = stmt.compile(dialect=dialect)
        binds = [(name, bp.type.dialect_impl(dialect).bind_processor(dialect)) for name, bp in compiled.binds.items()]
        defaults = {k: v for k, v in compiled.params.items() if v is not None}  # e.g. SQLite's OFFSET 0
        positional = dialect.paramstyle in ("qmark", "format", "numeric")
        order = list(compiled.positiontup or []) if positional else []

        def params_for(values: dict[str, Any]) -> Any:
            params = {**defaults, **values}
            for name, proc in binds:
                if proc is not None and name in params:
                    params[name] = proc(params[name])
            return [params[p] for p in order] if positional else params

        return compiled.string, params_for

    def _compile_fetcher(self, has_lo: bool) -> Callable[[str, str, int], Sequence[tuple]]:
        """Compile the chunk query once and run it on the raw DBAPI cursor: SQLAlchemy's result
        machinery costs about 0.5 us per row, more than PostgreSQL spends producing it. Type
        conversion still follows SQLAlchemy's own processors, applied only where a column has one."""
        dialect = self.engine.dialect
        sql, params_for = self._driver_call(self._chunk_statement(has_lo))
        impls = [self.table.c[c].type.dialect_impl(dialect) for c in self.column_names]
        active: list[tuple[int, Callable[[Any], Any]]] = []
        known = False
        raw = self.engine.raw_connection()
        self._raw = raw

        def learn(description: Sequence[Any]) -> None:
            # Result processors depend on the driver's column type code (PostgreSQL numeric
            # needs it), which only the first result's description tells.
            nonlocal known
            for i, (impl, desc) in enumerate(zip(impls, description, strict=True)):
                proc = impl.result_processor(dialect, desc[1])
                if proc is not None:
                    active.append((i, proc))
            known = True

        def convert(rows: Sequence[Any]) -> list[tuple]:
            if not active:
                return list(rows) if not rows or isinstance(rows[0], tuple) else [tuple(r) for r in rows]
            out = []
            for row in rows:
                lst = list(row)
                for i, p in active:
                    lst[i] = p(lst[i])
                out.append(tuple(lst))
            return out

        def run(lo: str, hi: str, n: int) -> Sequence[tuple]:
            values: dict[str, Any] = {"n": n, **self._key_params(hi, "h")}
            if has_lo:
                values.update(self._key_params(lo, "c"))
            cur = raw.cursor()
            try:
                cur.execute(sql, params_for(values))
                if not known:
                    learn(cur.description)
                count = cur.rowcount
                if count > 0 and hasattr(cur, "scroll"):
                    cur.scroll(count - 1, mode="absolute")
                    last = convert([cur.fetchone()])[0]
                    cur.scroll(0, mode="absolute")
                    return FetchedRows(cur, count, last, convert)
                rows = convert(cur.fetchall())
            except BaseException:
                cur.close()
                raise
            cur.close()
            return rows

        return run

    def fetch_keys(self, encoded_keys: Sequence[str]) -> list[tuple]:
        """The rows (still matching ``where``) whose keys are given; missing keys are absent."""
        if not encoded_keys:
            return []
        values = [decode_key(k) for k in encoded_keys]
        k = self._key_expr()
        cond = k.in_([v[0] for v in values]) if self.arity == 1 else k.in_(values)
        stmt = sa.select(*[self.table.c[c] for c in self.column_names]).where(cond)
        if self.where:
            stmt = stmt.where(sa.text(f"({self.where})"))
        stmt = stmt.order_by(*[self.table.c[c] for c in self.key_names])
        with self.engine.connect() as conn:
            return [tuple(r) for r in conn.execute(stmt)]

    def reset(self) -> None:
        """After a failed fetch: drop the hot-path connection (it may be broken) so the next fetch
        opens a fresh one."""
        raw, self._raw = self._raw, None
        self._fetchers.clear()
        if raw is not None:
            with contextlib.suppress(Exception):
                raw.invalidate()

    def close(self) -> None:
        raw = self._raw
        if raw is not None:
            raw.close()
            self._raw = None
            self._fetchers.clear()
        if self._owns_engine:
            self.engine.dispose()

    # ---- bounds ------------------------------------------------------------------------------
    def max_key(self, conn: sa.Connection) -> tuple | None:
        cols = [self.table.c[k] for k in self.key_names]
        stmt = sa.select(*cols).order_by(*[c.desc() for c in cols]).limit(1)
        if self.where:
            stmt = stmt.where(sa.text(f"({self.where})"))
        row = conn.execute(stmt).first()
        return None if row is None else tuple(row)

    def min_key(self) -> tuple | None:
        cols = [self.table.c[k] for k in self.key_names]
        stmt = sa.select(*cols).order_by(*cols).limit(1)
        with self.engine.connect() as conn:
            row = conn.execute(stmt).first()
        return None if row is None else tuple(row)

    def retention_boundary(self) -> str | None:
        """The encoded highest key the source may already have deleted (``retention_sql``: one
        row with the key columns, or no row / NULL for "nothing deleted"); None without it."""
        if not self.retention_sql:
            return None
        with self.engine.connect() as conn:
            row = conn.execute(sa.text(self.retention_sql)).first()
        if row is None or any(v is None for v in row):
            return None
        if len(row) != self.arity:
            raise ConfigurationError(
                f"retention_sql returned {len(row)} column(s); it must return the {self.arity} key column(s) "
                f"{self.key_names} of the highest key the source may have deleted")
        return encode_key(tuple(row))

    def upper_bound(self) -> str | None:
        """The encoded ``max(key)`` once every key at or below it is settled (see module doc)."""
        with self.engine.connect() as conn:
            top = self.max_key(conn)
            if self.dialect == "postgresql":
                self._wait_for_open_transactions(conn)
            elif self.settle_seconds > 0:
                time.sleep(self.settle_seconds)
        return None if top is None else encode_key(top)

    def _wait_for_open_transactions(self, conn: sa.Connection) -> None:
        # Every running transaction holds a lock on its own virtual transaction id, whether or not
        # it has an xid yet (nextval() alone may not assign one). A key below max(key) can only be
        # uncommitted if it belongs to one of the transactions running right after max(key) was
        # read; once they have all ended, nothing at or below the bound can still appear.
        open_now = sa.text(
            "SELECT l.virtualxid, a.pid, a.usename, a.application_name, a.xact_start, a.state "
            "FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid "
            "WHERE l.locktype = 'virtualxid' AND l.mode = 'ExclusiveLock' AND l.granted "
            "AND a.pid <> pg_backend_pid() AND a.datname = current_database()"
        )
        waiting = {r[0]: r for r in conn.execute(open_now)}
        deadline = time.monotonic() + self.commit_wait_timeout
        delay = 0.01
        while waiting:
            still = {r[0] for r in conn.execute(open_now)}
            waiting = {v: r for v, r in waiting.items() if v in still}
            if not waiting:
                return
            if time.monotonic() >= deadline:
                who = "; ".join(
                    f"pid {r[1]} user {r[2]} app {r[3]!r} open since {r[4]} ({r[5]})" for r in waiting.values()
                )
                raise CommitOrderTimeoutError(
                    f"{len(waiting)} transaction(s) open when the upper bound of {self.qualified_name!r} "
                    f"was read did not end within {self.commit_wait_timeout:.0f} s: {who}. A key they "
                    "hold could fall inside the round, so no round was saved. Let them finish (or "
                    "terminate them), or raise commit_wait_timeout."
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.5)

    # ---- planning support --------------------------------------------------------------------
    def estimate_rows(self, lo: str, hi: str) -> int:
        """Planner's row estimate for ``lo < key <= hi`` (PostgreSQL), exact count elsewhere."""
        stmt = sa.select(*[self.table.c[k] for k in self.key_names]).where(*self._range_filter(lo != MIN_KEY))
        params = self._key_params(hi, "h") | (self._key_params(lo, "c") if lo != MIN_KEY else {})
        with self.engine.connect() as conn:
            if self.dialect == "postgresql":
                sql, params_for = self._driver_call(stmt)
                plan: Any = conn.exec_driver_sql("EXPLAIN (FORMAT JSON) " + sql, params_for(params)).scalar()
                doc = plan if isinstance(plan, list) else json.loads(plan)
                return int(doc[0]["Plan"]["Plan Rows"])
            count = sa.select(sa.func.count()).select_from(stmt.subquery())
            return int(conn.execute(count, params).scalar() or 0)

    def quantile_keys(self, lo: str, hi: str, parts: int, exact_limit: int, sample_rows: int) -> list[str]:
        """Up to ``parts - 1`` real keys splitting ``(lo, hi]`` into parts of about equal row
        count: exact (one ordered pass) when the range is small, else from a block sample."""
        est = self.estimate_rows(lo, hi)
        params = self._key_params(hi, "h") | (self._key_params(lo, "c") if lo != MIN_KEY else {})
        keys = [self.table.c[k] for k in self.key_names]
        filt = self._range_filter(lo != MIN_KEY)
        with self.engine.connect() as conn:
            if self.dialect == "postgresql" and est > exact_limit:
                # Block sampling of a table stored in key order draws whole runs of neighbouring
                # keys, so read at least ~2048 blocks and thin them at random back to sample_rows.
                quote = self.engine.dialect.identifier_preparer.quote
                rel = (quote(self.schema) + "." if self.schema else "") + quote(self.table_name)
                pages = int(conn.execute(sa.text("SELECT relpages FROM pg_class WHERE oid = CAST(:r AS regclass)"),
                                         {"r": rel}).scalar() or 1)
                fraction = min(1.0, max(sample_rows / max(est, 1), 2048 / max(pages, 1)))
                keep = min(1.0, sample_rows / max(est * fraction, 1))
                sampled = self.table.tablesample(sa.func.system(100.0 * fraction), name="s")
                scols = [sampled.c[k] for k in self.key_names]
                stmt = sa.select(*scols).where(*self._range_filter(lo != MIN_KEY, on=sampled))
                if keep < 1.0:
                    stmt = stmt.where(sa.func.random() < keep)
                sample = sorted(tuple(r) for r in conn.execute(stmt, params))
                if len(sample) >= parts * 4:
                    step = len(sample) / parts
                    picks = [sample[round(step * i) - 1] for i in range(1, parts)]
                    return sorted({encode_key(p) for p in picks})
            total = int(conn.execute(sa.select(sa.func.count()).where(*filt).select_from(self.table), params)
                        .scalar() or 0)
            if total <= 1:
                return []
            step = max(1, -(-total // parts))
            rn = sa.func.row_number().over(order_by=keys).label("rn")
            inner = sa.select(*keys, rn).where(*filt).subquery()
            stmt = sa.select(*[inner.c[k] for k in self.key_names]).where(
                inner.c.rn % step == 0, inner.c.rn < total).order_by(*[inner.c[k] for k in self.key_names])
            return [encode_key(tuple(r)) for r in conn.execute(stmt, params)]
