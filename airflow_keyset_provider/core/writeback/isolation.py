"""Runs a helper's batch writes and, when a batch fails on a row's data, finds the guilty rows.

A batch that fails on a row's data is retried row by row, so only the guilty rows end up in
``failed`` and the others are written. Every attempt runs in a SAVEPOINT where the backend asks
for one (PostgreSQL: an error aborts the whole transaction otherwise), rolled back on error, so
a failed key leaves no trace and the caller's transaction stays usable. Whether an error is a
row's fault is decided by ``failures.py``; any other error is raised (and leaves the helper as
``RetryableError`` if it is the dependency's fault, see ``target.connection``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from .backends import Backend, BatchWrite
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
