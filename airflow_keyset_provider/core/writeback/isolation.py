"""Runs a helper's batch writes and, when a batch fails on a row's data, finds the guilty rows.

:class:`ColumnarWriter` (the columnar path) halves a failed batch down to the guilty rows and
takes no savepoint of its own (see its docstring). :class:`BatchWriter` (the row path): a batch
that fails on a row's data is retried row by row, so only the guilty rows end up in
``failed`` and the others are written. Every attempt runs in a SAVEPOINT where the backend asks
for one (PostgreSQL: an error aborts the whole transaction otherwise), rolled back on error, so
a failed key leaves no trace and the caller's transaction stays usable. Whether an error is a
row's fault is decided by ``failures.py``; any other error is raised (and leaves the helper as
``RetryableError`` if it is the dependency's fault, see ``target.connection``).
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import compress
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from .backends import Backend, BatchWrite, ColumnarPlan
from .columns import Columns
from .failures import Fault, describe
from .outcome import WriteOutcome
from .target import Key, KeyIndex, Target


class BatchWriter:
    """Writes the batches of one helper call and collects the per-key outcome."""

    def __init__(self, conn: Connection, target: Target, backend: Backend, isolate: bool) -> None:
        self.conn = conn
        self.target = target
        self.backend = backend
        self.isolate = isolate
        self.savepoints = isolate and backend.savepoint_per_statement
        self.written: list[Key] = []  # keys as read back from the database
        self.failed: dict[Key, str] = {}

    def write(self, batch: list, write: BatchWrite, key_of: Callable[[Any], Key]) -> None:
        """Write ``batch``; if it fails on a row's data, write its items one by one."""
        try:
            self.written.extend(self._execute(write, batch))
            return
        except sa.exc.DBAPIError as exc:
            if not self._row_fault(exc) or not self.isolate:
                raise
            if len(batch) == 1:
                self.failed[key_of(batch[0])] = describe(exc)
                return
        for item in batch:
            try:
                self.written.extend(self._execute(write, [item]))
            except sa.exc.DBAPIError as exc:
                if not self._row_fault(exc):
                    raise
                self.failed[key_of(item)] = describe(exc)

    def _row_fault(self, exc: sa.exc.DBAPIError) -> bool:
        """Is ``exc`` the row's fault? (Others are raised; ``connection()`` turns a dependency's
        into ``RetryableError``.)"""
        return self.backend.fault(exc) is Fault.ROW

    def _execute(self, write: BatchWrite, batch: list) -> list[Key]:
        if self.savepoints:
            with self.conn.begin_nested():
                return write(self.conn, batch)
        return write(self.conn, batch)

    def outcome(self, keys: list[Key]) -> WriteOutcome:
        """Every key of ``keys`` (the caller's, in input order) in exactly one field."""
        index = KeyIndex(keys)
        written = {index.lookup(k): None for k in self.written}
        applied = [k for k in keys if k in written and k not in self.failed]
        not_applied = [k for k in keys if k not in written and k not in self.failed]
        known = set(keys)
        applied.extend(k for k in written if k not in known)  # not matched back (defensive)
        failed = {k: self.failed[k] for k in keys if k in self.failed}
        return WriteOutcome(applied=applied, not_applied=not_applied, failed=failed)


#: ``bytearray.translate`` table: 1 (written) -> 0, 0 (not written) -> 1
_MISSED = bytes([1, 0]) + bytes(254)


class ColumnarWriter:
    """Writes a call's :class:`~.columns.Columns` batch by batch and collects the outcome by
    position. No savepoint is taken here: the backend's statement keeps the caller's
    transaction usable when it fails (PostgreSQL: a savepoint sent in the same round trip as
    the statement; MySQL/MariaDB: InnoDB rolls back the failed statement alone). Only a batch
    that failed on a row's data is written again, in halves, down to the guilty rows: a batch
    of n rows with one bad row costs about 2 log2(n) more statements, a clean one none."""

    def __init__(self, conn: Connection, backend: Backend, isolate: bool) -> None:
        self.conn = conn
        self.backend = backend
        self.isolate = isolate
        self.applied: list[int] = []  # positions in the call's Columns
        self.failed: dict[int, str] = {}

    def write(self, plan: ColumnarPlan, cols: Columns, batch_size: int) -> None:
        size = min(batch_size, plan.max_rows) if plan.max_rows else batch_size
        for start in range(0, cols.n, size):
            where = range(start, min(start + size, cols.n))
            if plan.batch_bytes is None:
                self._attempt(plan, cols, where)
            else:
                for part in self._fit(plan, cols, where):
                    self._attempt(plan, cols, part)

    def _fit(self, plan: ColumnarPlan, cols: Columns, where: range) -> list[range]:
        """``where`` cut in halves until each part's estimated statement fits the budget."""
        assert plan.batch_bytes is not None
        if len(where) <= 1 or plan.batch_bytes(cols.take(where)) <= plan.budget:
            return [where]
        mid = len(where) // 2
        return self._fit(plan, cols, where[:mid]) + self._fit(plan, cols, where[mid:])

    def _attempt(self, plan: ColumnarPlan, cols: Columns, where: range | list[int]) -> None:
        try:
            got = plan.write(self.conn, cols.take(where), len(where))
        except sa.exc.DBAPIError as exc:
            if not self.isolate or self.backend.fault(exc) is not Fault.ROW:
                raise
            if len(where) == 1:
                self.failed[where[0]] = describe(exc)
                return
            mid = len(where) // 2
            self._attempt(plan, cols, where[:mid])
            self._attempt(plan, cols, where[mid:])
            return
        if isinstance(where, range) and where.start == 0:
            self.applied.extend(got)
        else:
            self.applied.extend(where[p] for p in got)

    def outcome(self, cols: Columns) -> WriteOutcome:
        """Every key of the call in exactly one field, in input order."""
        hit = bytearray(cols.n)
        for p in self.applied:
            hit[p] = 1
        keys = cols.keys
        if self.failed:
            for p in self.failed:
                hit[p] = 2
            return WriteOutcome(
                applied=[k for k, h in zip(keys, hit, strict=True) if h == 1],
                not_applied=[k for k, h in zip(keys, hit, strict=True) if h == 0],
                failed={keys[p]: self.failed[p] for p in sorted(self.failed)},
            )
        return WriteOutcome(
            applied=list(compress(keys, hit)),
            not_applied=list(compress(keys, hit.translate(_MISSED))),
        )
