"""What differs per database, as one interface (``Dialect``); one module per database implements it.

The engine (``source``, ``key_checks``, ``sampling``) calls these methods and never compares a
dialect's name. Each method states what it proves; a database that cannot prove something refuses
it with an error naming the object and the fix, never silently skips the check.

- key validation: ``unique_indexes`` (what the catalog proves unique, and which indexes are ordered
  so a chunk is a range scan), ``never_null`` / ``implicit_unique`` (a key the catalog cannot show
  as NOT NULL or unique although it is, e.g. SQLite's rowid), ``check_key_column`` (types the key
  codec supports: ``key_types`` reads the catalog type, ``key_types.py`` is the one list of
  accepted types; ``check_relation``, ``check_key_column``), ``check_collation`` (text keys sort by code
  point) and ``not_null_fix`` (the statement a refusal quotes);
- the chunk filter: ``key_after`` / ``key_at_most`` (``key > lo`` and ``key <= hi`` in the form the
  database turns into an index range);
- values at plan time: ``check_key_values`` (what an accepted type holds but the codec cannot);
- commit order: ``check_commit_order`` (refuse what no wait can prove) and ``settle`` (wait until
  every key at or below the bound that will ever commit has committed);
- the planner: ``estimate_rows`` and ``sampled_cuts`` (``None``: cut exactly);
- the preview: ``explain_chunk`` (how the database will run the chunk query: ``ScanPlan``) and
  ``row_estimate`` (how ``estimate_rows`` knows: the optimizer's estimate, or an exact count);
- timeouts: ``session_statements`` (statement and lock timeouts for every connection of an engine
  the source created itself);
- write-back: ``classify_row_error`` (is a failed statement the row's fault, or transient?).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import sqlalchemy as sa

from ..key_types import KeyType

if TYPE_CHECKING:
    from ..catalog import IndexInfo
    from ..relation import Relation

RowErrorKind = Literal["row", "retry"]


@dataclass(frozen=True)
class KeyTypeFound:
    """A key column's type as the catalog names it (``label``), its rule, and the values the
    rule's fix is formatted with (e.g. the collation to use)."""

    label: str
    rule: KeyType
    fix_values: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class ScanPlan:
    """How the database says it will run the chunk query (``EXPLAIN``, no row read).

    ``scan``: ``"index range"`` (the chunk is read from an ordered index, from the cursor on,
    and the read stops after ``n`` rows), ``"full scan"`` (the table, or the whole range, is
    read and sorted: a chunk costs the table, not ``n`` rows), ``"unknown"`` (the plan was not
    recognised). ``index``: the index it reads; ``plan``: the plan as the database words it, one
    line a step; ``problem``: why the plan is not an index range scan, and the fix (None: none).
    """

    scan: str
    index: str | None = None
    plan: tuple[str, ...] = ()
    problem: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "scan": self.scan,
            "index": self.index,
            "plan": list(self.plan),
            "problem": self.problem,
        }


def full_scan_problem(src: Relation, how: str) -> str:
    """The words of a chunk query that is not an index range scan (``how``: what it does)."""
    return (
        f"the chunk query on {src.qualified_name} {how}: each chunk would cost a scan of the "
        f"table (or of the whole range), not of the chunk's rows. Check that an ordered index "
        f"starts with the key columns {list(src.key_names)}, that the table has statistics "
        "(ANALYZE), and that the where filter does not defeat the index; a small table may be "
        "planned this way legitimately"
    )


class Dialect:
    """The interface; the defaults are the behaviour a database without the feature gets."""

    name = ""
    #: how ``estimate_rows`` knows: ``"explain"`` (the optimizer's estimate, no row read) or
    #: ``"count"`` (an exact count of the range: a database without range estimates)
    row_estimate = "count"
    #: the reflected primary key is an ordered index (False: the catalog's index list decides)
    primary_key_is_ordered = True
    #: a chunk may stay in the driver's cursor until read (``fetch.FetchedRows``): the cursor is
    #: closed by whichever thread releases the chunk, while the prefetch thread may be running the
    #: next query on the same connection (False: the fetch reads and closes the cursor at once)
    lazy_chunks = True

    # ---- key validation ---------------------------------------------------------------------
    def unique_indexes(self, conn: sa.Connection, src: Relation) -> list[IndexInfo]:
        """Every index of the source's table, with what it proves (``IndexInfo``)."""
        raise NotImplementedError

    def reflect_columns(
        self, conn: sa.Connection, src: Relation
    ) -> tuple[list[dict[str, Any]], list[str]] | None:
        """The table's columns (``name``, ``type``, ``nullable``, as SQLAlchemy's Inspector
        reflects them) and its primary key's columns in key order, read by one hand-written
        catalog statement; None when this dialect does not answer (or the relation is not found):
        the Inspector then reads them, and refuses a missing table (``key_checks.reflect_table``)."""
        return None

    def never_null(self, table: sa.Table, col: sa.Column) -> bool:
        """True when ``col`` can never hold NULL although it reflects as nullable."""
        return False

    def implicit_unique(self, table: sa.Table) -> list[set[str]]:
        """Column sets unique without an index the catalog lists."""
        return []

    def key_types(
        self, conn: sa.Connection, src: Relation, columns: Sequence[str]
    ) -> dict[str, KeyTypeFound]:
        """Each key column's catalog type and its rule in ``key_types`` (the one allowlist)."""
        raise NotImplementedError

    def check_relation(self, conn: sa.Connection, src: Relation) -> None:
        """Refuse a table whose reads are not the rows its indexes cover (e.g. inheritance)."""

    def check_key_column(self, src: Relation, col: sa.Column) -> None:
        """Refuse a key column whose accepted type still needs a session setting."""

    def check_key_values(self, src: Relation, conn: sa.Connection) -> None:
        """At plan time: refuse values an accepted type holds but the key codec cannot
        (``key_types.VALUE_RULES``), where they sort: at the leading key column's edges."""

    def check_collation(self, src: Relation, key_cols: Sequence[sa.Column]) -> None:
        """Refuse a text key column (``key_cols``: the key's columns of kind text) that does not
        sort by code point (the cursors' order)."""

    def not_null_fix(self, src: Relation, col: sa.Column) -> str:
        return f"ALTER TABLE {src.qualified_name} ALTER COLUMN {col.name} SET NOT NULL"

    # ---- the chunk filter -------------------------------------------------------------------
    def key_after(self, cols: Sequence[Any], params: Sequence[Any]) -> Any:
        """``key > params`` (row-value comparison for a composite key)."""
        return cols[0] > params[0] if len(cols) == 1 else sa.tuple_(*cols) > sa.tuple_(*params)

    def key_at_most(self, cols: Sequence[Any], params: Sequence[Any]) -> Any:
        """``key <= params``."""
        return cols[0] <= params[0] if len(cols) == 1 else sa.tuple_(*cols) <= sa.tuple_(*params)

    # ---- commit order -----------------------------------------------------------------------
    def check_commit_order(self, src: Relation, conn: sa.Connection) -> None:
        """Refuse, before the bound is read, a source whose commit order no wait can prove."""

    def settle(self, src: Relation, conn: sa.Connection) -> None:
        """Called right after the bound was read: return once every key at or below it that will
        ever commit has committed, plus the ``settle_seconds`` window. The default (a database
        that serialises writers) sleeps the window only."""
        if src.settle_seconds > 0:
            time.sleep(src.settle_seconds)

    # ---- chunk sizing -----------------------------------------------------------------------
    def row_width(self, src: Relation, conn: sa.Connection) -> float | None:
        """The catalog's average bytes of a row of ``src``'s read columns, for the first chunk's
        byte budget (None: no statistics; the chunks' own rows are measured either way)."""
        return None

    # ---- the planner ------------------------------------------------------------------------
    def estimate_rows(
        self, src: Relation, conn: sa.Connection, stmt: sa.Select, params: dict[str, Any]
    ) -> int:
        """Rows ``stmt`` (the key columns of ``lo < key <= hi``) returns: the exact count here."""
        count = sa.select(sa.func.count()).select_from(stmt.subquery())
        return int(conn.execute(count, params).scalar() or 0)

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
        """Cut keys from a sample without a full scan; None: cut by one exact ordered pass."""
        return None

    # ---- the preview ------------------------------------------------------------------------
    def explain_chunk(
        self, src: Relation, conn: sa.Connection, stmt: sa.Select, params: dict[str, Any]
    ) -> ScanPlan:
        """How the database will run ``stmt`` (the chunk query with its bound ``params``)."""
        return ScanPlan("unknown", problem="this database's plans are not read")

    # ---- timeouts ---------------------------------------------------------------------------
    def session_statements(self, statement_s: float, lock_s: float) -> list[str]:
        """Statements run on every new connection of an engine the source created: a statement
        timeout of ``statement_s`` and a lock wait timeout of ``lock_s`` seconds."""
        return []

    # ---- write-back -------------------------------------------------------------------------
    def classify_row_error(self, exc: BaseException) -> RowErrorKind | None:
        """``"row"``: the statement failed because of the row's data (a constraint, a value out of
        range): retrying it fails again. ``"retry"``: transient (deadlock, lock or statement
        timeout, lost connection). None: not known to be either."""
        if isinstance(exc, (sa.exc.IntegrityError, sa.exc.DataError)):
            return "row"
        return None
