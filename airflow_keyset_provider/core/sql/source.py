"""A SQL table read in key order: validation, the round's upper bound, keyset chunks.

Guarantees (what differs per database is the source's ``Dialect``, ``dialects/``):

- ``validate`` refuses a database other than PostgreSQL, SQLite and MySQL/MariaDB, and a key
  that does not define a stable total order, with an error that names the object and the fix; it
  reads the catalog only (``key_checks``; the accepted key types are listed once, in ``key_types``).
  ``upper_bound`` and ``wait_for_commit_order`` also refuse values those types hold but the key
  codec cannot (infinities, NaN, zero dates, another SQLite storage class) at the leading key
  column's edges, honouring ``where`` (``Dialect.check_key_values``).
- ``upper_bound`` returns a bound such that every key ``<= bound`` that will ever commit has
  committed (or aborted) when it returns: on PostgreSQL it waits, bounded, for the transactions of
  this database (prepared ones included) that were open when ``max(key)`` was read
  (``commit_order``); on MySQL/MariaDB for the server's InnoDB transactions open then.
  ``wait_for_commit_order`` does the same wait for an explicit end. Both refuse what defeats that
  wait (PostgreSQL: a sequence with ``CACHE > 1`` feeding the key, a standby; MySQL: no PROCESS
  privilege, a table not in InnoDB) unless the caller opted into a ``settle_seconds`` window.
  SQLite serialises writers, so it needs no wait; ``settle_seconds`` there is a plain delay.
- ``fetch`` returns the rows with ``lo < key <= hi`` in key order, at most ``n`` of them, with one
  round trip, in the form the database turns into an index range scan (``Dialect.key_after``).
- ``estimate_rows`` and ``quantile_keys`` serve the planner (``sampling``); ``chunk_plan`` says
  how the database will run the chunk query (``Dialect.explain_chunk``: ``EXPLAIN``, no row read).
- every connection of an engine the source created itself gets a statement timeout
  (``STATEMENT_TIMEOUT_S``) and a lock wait timeout (``LOCK_TIMEOUT_S``) where the database has
  them (``Dialect.session_statements``); a caller's Engine keeps its own settings.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Callable, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from ..errors import ConfigurationError
from ..keys import MIN_KEY, decode_key, encode_key
from ..redaction import url_error
from ..row_data import hide_parameters
from . import dialects, key_checks, naming, sampling
from .dialects.base import ScanPlan
from .fetch import FetchedRows as FetchedRows  # re-exported: the fetcher moved to .fetch
from .fetch import compile_fetcher
from .fetch import driver_call as _driver_call_for
from .fetch import materialize as materialize
from .fetch import release as release
from .fetch import sample_rows as sample_rows
from .key_checks import _BYTE_ORDER_COLLATIONS as _BYTE_ORDER_COLLATIONS  # re-exported
from .key_checks import SUPPORTED_DIALECTS as SUPPORTED_DIALECTS  # re-exported

log = logging.getLogger(__name__)

#: statement timeout of every statement of an engine the source created (chunk reads included)
STATEMENT_TIMEOUT_S = 600.0
#: lock wait timeout of those statements (a DDL holding the table must not hang a plan for long)
LOCK_TIMEOUT_S = 10.0


def make_engine(url: str | Engine, name: naming.ConnectionName | None = None) -> Engine:
    """An autocommit engine: a traversal never holds a transaction (and so a snapshot) open
    between chunks. A bare ``postgresql://`` URL gets SQLAlchemy's default driver (psycopg 3 with
    SQLAlchemy 2.1); ``postgresql+psycopg2://`` selects psycopg2. Both work. An engine created
    here runs its dialect's timeout statements on every new connection, and its connections carry
    ``name`` (``naming``); a caller's is untouched."""
    if isinstance(url, Engine):
        return url.execution_options(isolation_level="AUTOCOMMIT")
    try:
        engine = sa.create_engine(  # hide_parameters: no row data in logs (row_data)
            url, isolation_level="AUTOCOMMIT", pool_pre_ping=True, hide_parameters=hide_parameters()
        )
    except (sa.exc.ArgumentError, sa.exc.NoSuchModuleError) as exc:
        raise ConfigurationError(
            url_error("source URL", url, exc)
        ) from None  # the cause may quote the password
    if name is not None:
        naming.name_connections(engine, name)

    @sa.event.listens_for(engine, "connect")
    def _timeouts(dbapi_conn: Any, _record: Any) -> None:
        # runs after the dialect's first-connect initialisation (server version known)
        db = dialects.for_engine(engine.dialect)
        statements = (
            [] if db is None else db.session_statements(STATEMENT_TIMEOUT_S, LOCK_TIMEOUT_S)
        )
        if not statements:
            return
        cur = dbapi_conn.cursor()
        try:
            for stmt in statements:
                cur.execute(stmt)
        finally:
            cur.close()
        commit = getattr(dbapi_conn, "commit", None)
        if commit is not None:
            commit()  # psycopg2 outside autocommit opened a transaction for the SETs

    return engine


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
        where_params: dict[str, Any] | None = None,
        commit_wait_timeout: float = 60.0,
        retention_sql: str | None = None,
        connection_name: naming.ConnectionName | None = None,
    ) -> None:
        if not isinstance(table, str) or not table.strip():
            raise ConfigurationError(
                "table must be a non-empty table name, e.g. 'events' or 'app.events'"
            )
        keys = (
            [key] if isinstance(key, str) else list(key) if isinstance(key, (list, tuple)) else []
        )
        if not keys or not all(isinstance(k, str) and k for k in keys):
            raise ConfigurationError(
                f"key must be a column name or a list of column names, got {key!r}"
            )
        if len(set(keys)) != len(keys):
            raise ConfigurationError(f"key lists a column twice: {keys}")
        if columns is not None and (
            isinstance(columns, str) or not all(isinstance(c, str) for c in columns)
        ):
            raise ConfigurationError(f"columns must be a list of column names, got {columns!r}")
        self._owns_engine = not isinstance(url, Engine)  # never dispose a caller's engine
        #: what this source's connections are called (``naming``); moved by the run per range
        self.connection_name = connection_name
        self.engine = make_engine(url, connection_name)
        self.dialect = self.engine.dialect.name
        self.db = dialects.for_engine(self.engine.dialect)  # None: refused by validate
        schema, _, name = table.rpartition(".")
        self.schema, self.table_name = schema or None, name
        self.key_names = keys
        self.arity = len(keys)
        self.where = where
        if where_params is not None and (not isinstance(where_params, dict) or not where):
            raise ConfigurationError(
                "where_params must be a dict of values bound into where "
                f"(e.g. where='tenant = :tenant'), got {where_params!r} with where={where!r}"
            )
        self.where_params = dict(where_params or {})
        if settle_seconds is None or settle_seconds < 0:
            raise ConfigurationError(f"settle_seconds must be >= 0, got {settle_seconds!r}")
        self.column_names = list(dict.fromkeys([*keys, *(columns or [])]))
        self.settle_seconds = settle_seconds
        self.commit_wait_timeout = commit_wait_timeout
        self.retention_sql = retention_sql
        self._table: sa.Table | None = None
        self._fetchers: dict[bool, Callable[[str, str, int], Sequence[tuple]]] = {}
        self._conns: list[
            sa.Connection
        ] = []  # the hot path's autocommit connections, closed by close()
        self._named = ""  # the name the held read connections carry
        self._row_width: tuple[float] | None = None  # row_width(), once read
        self.last_sample_percent: float | None = None  # TABLESAMPLE SYSTEM percent of the last plan

    # ---- validation --------------------------------------------------------------------------
    @property
    def qualified_name(self) -> str:
        return f"{self.schema}.{self.table_name}" if self.schema else self.table_name

    def fingerprint(self) -> str:
        """What identifies the traversed set; stored with a round."""
        doc: dict[str, Any] = {
            "table": self.qualified_name,
            "key": self.key_names,
            "where": self.where,
            "dialect": self.dialect,
        }
        if self.where_params:
            doc["where_params"] = self.where_params
        return json.dumps(doc, sort_keys=True, default=str)

    def _where_clause(self) -> Any:
        """The trusted ``where`` SQL with ``where_params`` bound as values (never spliced)."""
        clause = sa.text(f"({self.where})")
        return clause.bindparams(**self.where_params) if self.where_params else clause

    @property
    def rel(self) -> str:
        quote = self.engine.dialect.identifier_preparer.quote
        return (quote(self.schema) + "." if self.schema else "") + quote(self.table_name)

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
        """Refuse a key that does not give a stable total order (``key_checks``). Reads the
        catalog only."""
        self._table, self.key_kinds = key_checks.validate(self, self.db)

    # ---- encoding ----------------------------------------------------------------------------
    def encode(self, key_values: Sequence[Any]) -> str:
        return encode_key(key_values)

    def key_params(self, encoded: str, prefix: str) -> dict[str, Any]:
        values = decode_key(encoded)
        return {f"{prefix}{i}": v for i, v in enumerate(values)}

    def _key_expr(self, on: Any = None) -> Any:
        t = self.table if on is None else on
        cols = [t.c[k] for k in self.key_names]
        return cols[0] if self.arity == 1 else sa.tuple_(*cols)

    def _params(self, prefix: str) -> list[Any]:
        cols = [self.table.c[k] for k in self.key_names]
        return [sa.bindparam(f"{prefix}{i}", type_=c.type) for i, c in enumerate(cols)]

    def range_filter(self, has_lo: bool, on: Any = None) -> list[Any]:
        """``lo < key <= hi [AND where]`` in the dialect's index-range form (row-value comparison
        where the database ranges on it), on the table or a sample of it."""
        assert self.db is not None  # validated
        t = self.table if on is None else on
        cols = [t.c[k] for k in self.key_names]
        conds = [self.db.key_at_most(cols, self._params("h"))]
        if has_lo:
            conds.insert(0, self.db.key_after(cols, self._params("c")))
        if self.where:
            conds.append(self._where_clause())
        return conds

    def _chunk_statement(self, has_lo: bool) -> sa.Select:
        cols = [self.table.c[c] for c in self.column_names]
        return (
            sa.select(*cols)
            .where(*self.range_filter(has_lo))
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
        name = self.connection_name
        if name is not None and self._owns_engine and self._named != name.text:
            self._rename_held(name)
        fetcher = self._fetchers.get(has_lo)
        if fetcher is None:
            fetcher = self._fetchers[has_lo] = self._compile_fetcher(has_lo)
        return fetcher(lo, hi, n)

    def _rename_held(self, name: naming.ConnectionName) -> None:
        """The held read connections follow the traversal to its new range: renamed in place
        (PostgreSQL) or given back to the pool, whose checkout reopens them under the new name
        (MariaDB with PyMySQL; ``naming``)."""
        if naming.renames_in_place(self.engine):
            for conn in self._conns:
                naming.rename(conn.connection, name)
        elif naming.names_at_connect(self.engine) and self._conns:
            conns, self._conns = self._conns, []
            self._fetchers.clear()
            for held in conns:
                held.close()
        self._named = name.text

    def driver_call(self, stmt: Any) -> tuple[str, Callable[[dict[str, Any]], Any]]:
        """``fetch.driver_call`` for this source's dialect."""
        return _driver_call_for(self.engine.dialect, stmt)

    def _compile_fetcher(self, has_lo: bool) -> Callable[[str, str, int], Sequence[tuple]]:
        """The chunk query compiled onto a connection of its own (``fetch.compile_fetcher``)."""
        stmt = self._chunk_statement(has_lo)
        types = [self.table.c[c].type for c in self.column_names]

        def key_values(lo: str, hi: str) -> dict[str, Any]:
            values = self.key_params(hi, "h")
            if has_lo:
                values.update(self.key_params(lo, "c"))
            return values

        # An autocommit Connection of this source's engine (a caller's Engine gets autocommit
        # through execution options, restored when the connection returns to the caller's pool):
        # between chunks the backend is idle, holding no snapshot and no lock. Closed by close().
        conn = self.engine.connect()
        self._conns.append(conn)
        lazy = self.db is None or self.db.lazy_chunks
        return compile_fetcher(conn, stmt, types, key_values, lazy=lazy)

    def fetch_keys(self, encoded_keys: Sequence[str]) -> list[tuple]:
        """The rows (still matching ``where``) whose keys are given; missing keys are absent."""
        if not encoded_keys:
            return []
        values = [decode_key(k) for k in encoded_keys]
        k = self._key_expr()
        cond = k.in_([v[0] for v in values]) if self.arity == 1 else k.in_(values)
        stmt = sa.select(*[self.table.c[c] for c in self.column_names]).where(cond)
        if self.where:
            stmt = stmt.where(self._where_clause())
        stmt = stmt.order_by(*[self.table.c[c] for c in self.key_names])
        with self.engine.connect() as conn:
            return [tuple(r) for r in conn.execute(stmt)]

    def reset(self) -> None:
        """After a failed fetch: drop the hot-path connections (they may be broken) so the next
        fetch opens a fresh one."""
        conns, self._conns = self._conns, []
        self._fetchers.clear()
        for conn in conns:
            with contextlib.suppress(Exception):
                conn.invalidate()
            with contextlib.suppress(Exception):
                conn.close()

    def close(self) -> None:
        """Close every connection this source opened (a caller's engine is not disposed)."""
        conns, self._conns = self._conns, []
        self._fetchers.clear()
        for conn in conns:
            conn.close()
        if self._owns_engine:
            self.engine.dispose()

    # ---- bounds ------------------------------------------------------------------------------
    def max_key(self, conn: sa.Connection, *, lowest: bool = False) -> tuple | None:
        """``max(key)`` (``lowest``: ``min(key)``) of the rows the ``where`` selects, or None."""
        cols = [self.table.c[k] for k in self.key_names]
        order = [c.asc() if lowest else c.desc() for c in cols]
        stmt = sa.select(*cols).order_by(*order).limit(1)
        if self.where:
            stmt = stmt.where(self._where_clause())
        row = conn.execute(stmt).first()
        return None if row is None else tuple(row)

    def lowest_key(self) -> str | None:
        """The encoded ``min(key)`` now (one index probe): where a round that starts below every
        key really starts, for its progress figure only (never a bound)."""
        self.ensure_validated()
        with self.engine.connect() as conn:
            low = self.max_key(conn, lowest=True)
        return None if low is None else encode_key(low)

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
                f"{self.key_names} of the highest key the source may have deleted"
            )
        return encode_key(tuple(row))

    def upper_bound(self) -> str | None:
        """The encoded ``max(key)`` once every key at or below it is settled (see module doc).
        Refuses (``ConfigurationError``) what would defeat the wait, before reading anything."""
        self.ensure_validated()
        with self.engine.connect() as conn:
            self._check_commit_order(conn)
            self._check_key_values(conn)
            top = self.max_key(conn)
            self._settle(conn)
        return None if top is None else encode_key(top)

    def wait_for_commit_order(self) -> None:
        """For an explicit end (a data-interval backfill): return once every transaction that was
        open on entry has ended (PostgreSQL), so a key at or below the end that was written before
        the call is visible, plus the ``settle_seconds`` window. Same checks as ``upper_bound``."""
        self.ensure_validated()
        with self.engine.connect() as conn:
            self._check_commit_order(conn)
            self._check_key_values(conn)
            self._settle(conn)

    def probe(
        self,
        conn: sa.Connection,
        condition: str,
        params: dict[str, Any],
        select: str = "1",
        order: str = "",
    ) -> Any:
        """See ``Relation.probe``: one index probe of the dialects' value checks."""
        sql = f"SELECT {select} FROM {self.rel} WHERE ({condition})"
        if self.where:
            sql += f" AND ({self.where})"
        if order:
            sql += f" ORDER BY {order}"
        return conn.execute(
            sa.text(sql + " LIMIT 1").bindparams(**params, **self.where_params)
        ).scalar()

    def _check_key_values(self, conn: sa.Connection) -> None:
        """Refuse values the key's types hold but the key codec cannot, where they sort
        (``Dialect.check_key_values``, ``key_types.VALUE_RULES``)."""
        assert self.db is not None  # validated
        self.db.check_key_values(self, conn)

    def _settle(self, conn: sa.Connection) -> None:
        """Right after the bound was read: the dialect's wait (see module doc)."""
        assert self.db is not None  # validated
        self.db.settle(self, conn)

    def _check_commit_order(self, conn: sa.Connection) -> None:
        """Refuse, at plan time, a source whose commit order no wait can prove, unless
        ``settle_seconds`` opts in (``Dialect.check_commit_order``)."""
        assert self.db is not None  # validated
        self.db.check_commit_order(self, conn)

    def row_width(self) -> float | None:
        """The catalog's average bytes of a row of the read columns (``Dialect.row_width``;
        None without statistics), read once per source; never fails a run."""
        if self._row_width is None:
            width: float | None = None
            try:
                assert self.db is not None  # validated
                with self.engine.connect() as conn:
                    width = self.db.row_width(self, conn)
            except Exception:  # an estimate only: the chunks' own rows take over
                log.debug("no catalog row width for %s", self.qualified_name, exc_info=True)
            self._row_width = (width or 0.0,)
        return self._row_width[0] or None

    # ---- planning support --------------------------------------------------------------------
    def estimate_rows(self, lo: str, hi: str) -> int:
        """Planner's row estimate for ``lo < key <= hi`` (PostgreSQL), exact count elsewhere
        (``sampling.estimate_rows``)."""
        assert self.db is not None  # validated
        return sampling.estimate_rows(self, self.db, lo, hi)

    @property
    def row_estimate(self) -> str:
        """How ``estimate_rows`` knows (``Dialect.row_estimate``: ``"explain"`` or ``"count"``)."""
        return self.db.row_estimate if self.db is not None else "count"

    def chunk_plan(self, lo: str, hi: str, n: int) -> ScanPlan:
        """How the database will run the chunk query for ``lo < key <= hi`` with at most ``n``
        rows: the statement ``fetch`` runs, explained (``Dialect.explain_chunk``), never run."""
        assert self.db is not None  # validated
        has_lo = lo != MIN_KEY
        stmt = self._chunk_statement(has_lo)
        params = {**self.key_params(hi, "h"), "n": n}
        if has_lo:
            params.update(self.key_params(lo, "c"))
        with self.engine.connect() as conn:
            return self.db.explain_chunk(self, conn, stmt, params)

    def quantile_keys(
        self, lo: str, hi: str, parts: int, exact_limit: int, sample_rows: int
    ) -> list[str]:
        """Up to ``parts - 1`` real keys splitting ``(lo, hi]`` into parts of about equal row
        count: exact (one ordered pass) when the range is small, else from a block sample
        (``sampling.quantile_keys``)."""
        assert self.db is not None  # validated
        return sampling.quantile_keys(self, self.db, lo, hi, parts, exact_limit, sample_rows)
