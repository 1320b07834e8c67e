"""SQLite behind the ``Dialect`` interface.

- uniqueness: a unique index without predicate or expression (``PRAGMA index_list/xinfo``), or
  the rowid: only a column declared exactly ``INTEGER PRIMARY KEY`` in a rowid table aliases it
  (never NULL, unique, ordered, listed by no index); ``BIGINT PRIMARY KEY`` or ``INT PRIMARY KEY``
  is an ordinary column that accepts NULL unless declared NOT NULL;
- key types: the declared type's affinity, or the declared type of a ``STRICT`` table, and its rule
  in ``key_types``; a column of a table that is not ``STRICT`` holds any storage class, so at plan
  time the leading key column's lowest and highest values must be of the kind's class
  (``check_key_values``: two index probes);
- text keys: only the ``BINARY`` collation (UTF-8 bytes, i.e. code points); ``NOCASE`` and
  ``RTRIM`` are refused (read from the table's ``CREATE TABLE`` text: no pragma gives it);
- commit order: SQLite serialises writers, so a key committed is committed in order; the
  ``settle_seconds`` window is a plain delay (the base class);
- planner: exact counts and one ordered pass (the base class);
- preview: the chunk query's ``EXPLAIN QUERY PLAN`` (``explain_chunk``: ``SEARCH ... USING`` an
  index or the rowid without a temporary B-tree for the ORDER BY is an index range scan);
- timeouts: none beyond the driver's busy timeout (SQLite has no statement timeout); a wait for
  another connection's lock that outlasted it (``SQLITE_BUSY``, ``SQLITE_LOCKED``: "database is
  locked") is transient (``classify_row_error``: ``"retry"``).
"""

from __future__ import annotations

import re
import sqlite3
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from sqlalchemy.dialects.sqlite import base as sqlite_base

from ...errors import KeyValidationError, UnsupportedKeyTypeError
from .. import key_types
from ..catalog import IndexInfo
from .base import Dialect, KeyTypeFound, RowErrorKind, ScanPlan, full_scan_problem

if TYPE_CHECKING:
    from ..relation import Relation

_COLLATE = re.compile(r"\bCOLLATE\s+([\"'`\[]?)(\w+)[\"'`\]]?", re.IGNORECASE)
_PK_DESC = re.compile(r"\bPRIMARY\s+KEY\s+DESC\b", re.IGNORECASE)
_STORAGE_CLASS = {"int": "integer", "text": "text"}
_BUSY_CODES = frozenset({5, 6})  # SQLITE_BUSY, SQLITE_LOCKED (primary result codes)
_BUSY_MESSAGES = ("database is locked", "database table is locked", "database is busy")


def _reads_as(declared: str, kind: str) -> bool:
    """SQLAlchemy reads (and binds) the declared type as the kind's Python type: ``DATE_CHAR``
    has TEXT affinity but SQLAlchemy binds it as a date."""
    base = declared.split("(")[0].strip().upper()
    found = sqlite_base.ischema_names.get(base)
    want = sa.Integer if kind == "int" else sa.String
    return found is None or issubclass(found, want)


def affinity(declared: str) -> str:
    """SQLite's rules for a declared type's affinity (datatype3.html, section 3.1)."""
    t = declared.upper()
    if "INT" in t:
        return "INTEGER"
    if any(s in t for s in ("CHAR", "CLOB", "TEXT")):
        return "TEXT"
    if "BLOB" in t or not t.strip():
        return "BLOB"
    if any(s in t for s in ("REAL", "FLOA", "DOUB")):
        return "REAL"
    return "NUMERIC"


@dataclass(frozen=True)
class _Column:
    declared: str
    not_null: bool
    pk: int
    definition: str  # the column's text in CREATE TABLE ('' when not found)


@dataclass(frozen=True)
class _Table:
    strict: bool
    without_rowid: bool
    columns: dict[str, _Column]

    @property
    def rowid(self) -> str | None:
        """The column aliasing the rowid: the only primary key column, declared exactly
        ``INTEGER``, not ``PRIMARY KEY DESC``, in a rowid table."""
        pks = [n for n, c in self.columns.items() if c.pk]
        if self.without_rowid or len(pks) != 1:
            return None
        c = self.columns[pks[0]]
        if c.declared.strip().upper() != "INTEGER" or _PK_DESC.search(c.definition):
            return None
        return pks[0]


def _split_definitions(sql: str) -> list[str]:
    """The top-level comma-separated parts of ``CREATE TABLE t ( ... )``."""
    body = sql[sql.index("(") + 1 : sql.rindex(")")]
    parts: list[str] = []
    cur: list[str] = []
    depth, quote = 0, ""
    for ch in body:
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "\"'`[":
            quote = "]" if ch == "[" else ch
        elif ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append("".join(cur).strip())
            cur = []
            continue
        cur.append(ch)
    parts.append("".join(cur).strip())
    return parts


def _first_name(definition: str) -> str:
    d = definition.strip()
    if d[:1] in '"`[':
        end = {"[": "]"}.get(d[0], d[0])
        return d[1 : d.index(end, 1)]
    return d.split(None, 1)[0] if d else ""


def _read_table(conn: sa.Connection, name: str) -> _Table:
    quoted = '"' + name.replace('"', '""') + '"'
    listed = conn.exec_driver_sql(f"PRAGMA table_list({quoted})").first()
    strict = bool(listed[5]) if listed is not None else False
    without_rowid = bool(listed[4]) if listed is not None else False
    sql = conn.execute(
        sa.text("SELECT sql FROM sqlite_master WHERE type = 'table' AND name = :n"), {"n": name}
    ).scalar()
    defs = {_first_name(d).lower(): d for d in _split_definitions(sql or "()")}
    cols = {}
    for row in conn.exec_driver_sql(f"PRAGMA table_xinfo({quoted})").all():
        # (cid, name, type, notnull, dflt_value, pk, hidden)
        cols[str(row[1])] = _Column(
            str(row[2] or ""), bool(row[3]), int(row[5]), defs.get(str(row[1]).lower(), "")
        )
    return _Table(strict, without_rowid, cols)


class SqliteDialect(Dialect):
    name = "sqlite"

    def __init__(self) -> None:
        self._table: _Table | None = None  # read by key_types, used by the later checks

    def _described(self, src: Relation) -> _Table:
        if self._table is None:
            with src.engine.connect() as conn:
                self._table = _read_table(conn, src.table_name)
        return self._table

    def unique_indexes(self, conn: sa.Connection, src: Relation) -> list[IndexInfo]:
        """``PRAGMA index_list`` / ``index_xinfo``: partial indexes and expression key parts are
        marked (an INTEGER PRIMARY KEY, the rowid, is in no index: ``implicit_unique``)."""
        out = []
        quoted = '"' + src.table_name.replace('"', '""') + '"'
        for row in conn.exec_driver_sql(f"PRAGMA index_list({quoted})").all():
            name, unique, partial = row[1], bool(row[2]), bool(row[4])
            qname = '"' + str(name).replace('"', '""') + '"'
            info = conn.exec_driver_sql(f"PRAGMA index_xinfo({qname})").all()
            # index_xinfo: (seqno, cid, name, desc, coll, key); cid -2 is an expression, -1 the rowid
            cols = tuple(None if r[1] == -2 else r[2] for r in info if r[5])
            out.append(IndexInfo(str(name), cols, unique, partial))
        return out

    def key_types(
        self, conn: sa.Connection, src: Relation, columns: Sequence[str]
    ) -> dict[str, KeyTypeFound]:
        """The rowid alias, a STRICT table's declared type, or the declared type's affinity."""
        self._table = table = _read_table(conn, src.table_name)
        out = {}
        for name in columns:
            c = table.columns[name]
            if table.rowid == name:
                form = "INTEGER PRIMARY KEY"
            elif table.strict:
                form = f"STRICT {c.declared.strip().upper() or 'ANY'}"
            else:
                form = affinity(c.declared)
            label = f"{c.declared or '(none)'} ({form if table.strict else form + ' affinity'})"
            r = key_types.rule("sqlite", form)
            if r.kind is not None and not _reads_as(c.declared, r.kind):
                r = key_types.SQLITE["SQLAlchemy type"]
            out[name] = KeyTypeFound(label, r)
        return out

    def check_collation(self, src: Relation, key_cols: Sequence[sa.Column]) -> None:
        """Only ``BINARY`` compares by code point; ``NOCASE`` folds ASCII case, ``RTRIM``
        ignores trailing spaces."""
        table = self._described(src)
        for col in key_cols:
            found = _COLLATE.search(table.columns[col.name].definition)
            coll = found.group(2).upper() if found else "BINARY"
            if coll != "BINARY":
                raise KeyValidationError(
                    f"text key column {col.name!r} of {src.qualified_name!r} uses collation {coll}, "
                    "which does not order by code point (NOCASE folds case, RTRIM ignores trailing "
                    "spaces), so cursors compared in Redis would disagree with the database. Fix: "
                    "recreate the column without COLLATE (BINARY), or page by another key."
                )

    def not_null_fix(self, src: Relation, col: sa.Column) -> str:
        return (
            f"recreate {src.qualified_name} with {col.name} declared NOT NULL (SQLite cannot alter "
            "a column; only a column declared exactly INTEGER PRIMARY KEY is the rowid, never NULL)"
        )

    def never_null(self, table: sa.Table, col: sa.Column) -> bool:
        # the rowid alias, and a primary key column of a WITHOUT ROWID table (SQLite enforces
        # NOT NULL there), can never be NULL although they reflect as nullable
        t = self._table
        if t is None:
            return False
        return t.rowid == col.name or (t.without_rowid and t.columns[col.name].pk > 0)

    def implicit_unique(self, table: sa.Table) -> list[set[str]]:
        rowid = self._table.rowid if self._table is not None else None
        return [{rowid}] if rowid else []

    def explain_chunk(
        self, src: Relation, conn: sa.Connection, stmt: sa.Select, params: dict[str, Any]
    ) -> ScanPlan:
        """The chunk query's ``EXPLAIN QUERY PLAN``: ``SEARCH <table> USING ... INDEX`` (or
        ``INTEGER PRIMARY KEY``) with no ``USE TEMP B-TREE FOR ORDER BY`` is an index range scan;
        ``SCAN <table>`` without an index, or a temporary B-tree, reads the table first."""
        sql, params_for = src.driver_call(stmt)
        args = params_for(params)
        args = tuple(args) if isinstance(args, list) else args
        details = tuple(str(r[-1]) for r in conn.exec_driver_sql("EXPLAIN QUERY PLAN " + sql, args))
        sorts = any("TEMP B-TREE" in d.upper() for d in details)
        search = next((d for d in details if d.upper().startswith("SEARCH")), None)
        if search is not None and not sorts:
            match = re.search(r"USING (?:COVERING )?INDEX (\S+)", search)
            index = match.group(1) if match else "rowid"
            return ScanPlan("index range", index, details)
        how = "sorts the rows it reads (temporary B-tree)" if sorts else "scans the table"
        return ScanPlan("full scan", None, details, full_scan_problem(src, how))

    def classify_row_error(self, exc: BaseException) -> RowErrorKind | None:
        orig = getattr(exc, "orig", exc)
        code = getattr(orig, "sqlite_errorcode", None)  # Python 3.11+: the extended result code
        if (isinstance(code, int) and (code & 0xFF) in _BUSY_CODES) or (
            isinstance(orig, sqlite3.OperationalError)
            and any(m in str(orig) for m in _BUSY_MESSAGES)
        ):
            return "retry"  # another connection held the lock past the busy timeout
        return super().classify_row_error(exc)

    def check_key_values(self, src: Relation, conn: sa.Connection) -> None:
        """A leading key column of a table that is not STRICT (and not the rowid) holds only its
        kind's storage class at both ends of its order (SQLite sorts NULL < integers and reals
        < text < blobs, so another class sits at an end)."""
        table = self._described(src)
        name = src.key_names[0]
        want = _STORAGE_CLASS.get(src.key_kinds[0])
        if table.strict or table.rowid == name or want is None:
            return
        col = src.engine.dialect.identifier_preparer.quote(name)
        for order in ("ASC", "DESC"):
            got = src.probe(conn, "1 = 1", {}, select=f"typeof({col})", order=f"{col} {order}")
            if got is not None and got != want:
                raise UnsupportedKeyTypeError(
                    f"key column {name!r} of {src.qualified_name!r} holds a value of storage class "
                    f"{got!r} among its {want} keys (the table is not STRICT, so a column holds "
                    "any type, and SQLite sorts integers < text < blobs): the key encoding has no "
                    f"place for it. Fix: convert or delete those rows (WHERE typeof({name}) <> "
                    f"'{want}'), or recreate the table STRICT."
                )
