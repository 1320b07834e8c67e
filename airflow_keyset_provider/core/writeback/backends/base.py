"""The interface behind which the write-back helpers keep everything that differs per database.

A helper states *what* to write (a guarded update of these keys, these per-row values, these
rows to upsert); a ``Backend`` says *how* on its database family, as a :class:`Plan` per shape
of batch: the function that writes one batch and returns the keys it wrote, and what bounds a
batch (bound parameters per row, a row cap). Everything else (reflection, the outcome, the
row-by-row isolation of a failing batch, error classification) is shared.

Adding a database family is adding one module next to ``postgresql.py`` and ``sqlite.py`` that
subclasses :class:`Backend`, plus its dialect name in ``backends/__init__.py``. A database
without ``UPDATE ... RETURNING`` (``mysql.py``) gives plans whose ``write`` finds the written
keys another way (it locks and reads them first in the same transaction); one that limits
statements by bytes instead of parameters (``max_allowed_packet``) overrides
:meth:`Backend.batches` and gives its plans a ``row_bytes`` estimate.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import sqlalchemy as sa
from sqlalchemy.engine import Connection
from sqlalchemy.sql.elements import ColumnElement

from ..batching import guard_params, split
from ..failures import Fault, fault_of
from ..target import Guard, Key, Target

#: Writes one batch inside the caller's transaction and returns the keys of the rows it wrote,
#: as the database returns them.
BatchWrite = Callable[[Connection, list], list[Key]]

#: Turns a batch into ``(statement, parameters)`` for a statement that RETURNs the written keys.
#: Statement shapes are chosen so that SQLAlchemy compiles them once and then only binds
#: values: a multi-row ``VALUES`` cannot be cached by SQLAlchemy and cost ~90 us per row to
#: compile here, more than the write itself.
Builder = Callable[[list], tuple[Any, Any]]


@dataclass(frozen=True)
class Plan:
    """How batches of one shape are written on one database."""

    write: BatchWrite
    params_per_row: int = 0  # bound parameters each row adds (0: the count does not grow)
    fixed_params: int = 0  # bound parameters of the statement whatever the batch size
    max_rows: int | None = None  # most rows one statement should carry on this database
    #: Estimated bytes one item adds to the largest statement of its batch, for databases that
    #: bound a statement by size (MySQL's ``max_allowed_packet``); None: not estimated.
    row_bytes: Callable[[Any], int] | None = None


#: Writes the columns of one batch (``{column: values}``, ``n`` rows) inside the caller's
#: transaction and returns the positions (0-based, within the batch) of the rows it wrote. A
#: row's data error leaves as ``sa.exc.DBAPIError`` with the caller's transaction usable (the
#: columnar writer then bisects the batch, see ``isolation.py``).
ColumnarWrite = Callable[[Connection, dict[str, list], int], list[int]]


@dataclass(frozen=True)
class ColumnarPlan:
    """How batches of one shape are written from columns on one database: one statement per
    batch (PostgreSQL) or a locking read and one statement (MySQL/MariaDB), compiled once."""

    write: ColumnarWrite
    max_rows: int | None = None  # most rows one statement should carry on this database
    #: Estimated statement bytes of a batch's columns (``max_allowed_packet``); None: no limit.
    batch_bytes: Callable[[dict[str, list]], int] | None = None
    budget: int = 0  # most estimated bytes of a batch when ``batch_bytes`` is set


def returning(target: Target, build: Builder) -> BatchWrite:
    """A batch write for statements that end in ``RETURNING <key columns>``."""

    def write(conn: Connection, batch: list) -> list[Key]:
        stmt, params = build(batch)
        return [target.key_from_result(r) for r in conn.execute(stmt, params).all()]

    return write


class KeyIn:
    """Builds ``key IN (batch)``: plain ``IN`` for one column, row-value ``IN`` for several."""

    def __init__(self, target: Target) -> None:
        self.target = target
        self.params_per_key = len(target.key_cols)

    def __call__(self, batch: list[Key]) -> ColumnElement[bool]:
        cols = self.target.key_cols
        if self.target.composite:
            return sa.tuple_(*cols).in_(batch)
        return cols[0].in_(batch)


class Backend:
    """One database family. Subclasses set ``name`` and implement the ``NotImplementedError``
    methods; the others are defaults that fit databases with ``UPDATE ... RETURNING``."""

    name: ClassVar[str] = ""
    #: Run every statement in a SAVEPOINT, so a failing one leaves the caller's transaction
    #: usable (PostgreSQL aborts the whole transaction on an error otherwise).
    savepoint_per_statement: ClassVar[bool] = True
    #: Driver error numbers (``exc.orig.args[0]``) and their fault, for databases without
    #: SQLSTATEs in their driver's errors (MySQL/MariaDB); see ``failures.py``.
    error_numbers: ClassVar[Mapping[int, Fault]] = {}

    def check(self, conn: Connection) -> None:
        """Refuse (``ConfigurationError``) a server too old for the helpers."""

    def autocommit(self, conn: Connection) -> bool:
        """Does ``conn``'s driver connection commit each statement by itself (AUTOCOMMIT)?"""
        return getattr(conn.connection.dbapi_connection, "autocommit", False) is True

    def max_params(self, conn: Connection) -> int:
        """Most bound parameters one statement may carry on this connection."""
        raise NotImplementedError

    def key_in(self, target: Target) -> KeyIn:
        return KeyIn(target)

    def guarded_update(
        self,
        target: Target,
        values: Mapping[str, Any],
        guard: ColumnElement[bool] | None,
        expected: Guard,
    ) -> Plan:
        """``UPDATE t SET values WHERE key IN (batch) AND guard RETURNING key``."""
        key_in = self.key_in(target)
        stmt = sa.update(target.table).values(dict(values)).returning(*target.key_cols)
        if guard is not None:
            stmt = stmt.where(guard)

        def build(batch: list[Key]) -> tuple[sa.Update, None]:
            return stmt.where(key_in(batch)), None

        fixed = len(values) + guard_params(expected)
        return Plan(returning(target, build), key_in.params_per_key, fixed)

    def update_rows(
        self,
        target: Target,
        value_cols: list[str],
        guard: ColumnElement[bool] | None,
        expected: Guard,
    ) -> Plan:
        """Each row of a batch gets its own ``value_cols`` values, rows matched by key."""
        raise NotImplementedError

    def upsert(
        self,
        target: Target,
        columns: list[str],
        conflict_cols: Sequence[str],
        update_cols: list[str],
        batch_size: int,
    ) -> Plan:
        """Insert rows of ``columns``; on a ``conflict_cols`` conflict keep the row or set
        ``update_cols`` where they differ; write back the keys of rows inserted or changed."""
        raise NotImplementedError

    def columnar_update(
        self,
        conn: Connection,
        target: Target,
        value_cols: Sequence[str],
        constants: Mapping[str, Any],
        expected: Guard,
        isolate: bool,
    ) -> ColumnarPlan | None:
        """``SET value_cols = each row's values, constants = the same value for every row``
        where the key matches and the ``{column: value}`` guard holds, from columns; None when
        this database, these column types or this guard need the row path (the default).
        ``isolate``: keep the caller's transaction usable when the statement fails."""
        return None

    def columnar_upsert(
        self,
        conn: Connection,
        target: Target,
        columns: Sequence[str],
        conflict_cols: Sequence[str],
        update_cols: Sequence[str],
        isolate: bool,
    ) -> ColumnarPlan | None:
        """The upsert of :meth:`upsert` from columns; positions of rows inserted or changed.
        None when the row path is needed (the default)."""
        return None

    def fault(self, exc: sa.exc.DBAPIError) -> Fault:
        """Whose fault ``exc`` is (row, dependency, configuration), see ``failures.py``."""
        return fault_of(exc, self.error_numbers)

    def lock_for_claim(self, stmt: sa.Select) -> sa.Select:
        """Make ``claim_skip_locked``'s SELECT skip and lock rows, where the database can."""
        return stmt

    def batches(self, conn: Connection, items: list, batch_size: int, plan: Plan) -> Iterator[list]:
        """Split ``items`` into the batches one statement each writes."""
        size = min(batch_size, plan.max_rows) if plan.max_rows else batch_size
        return split(items, size, self.max_params(conn), plan.params_per_row, plan.fixed_params)
