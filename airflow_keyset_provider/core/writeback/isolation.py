"""Runs a helper's batch writes and, when a batch fails on a row's data, finds the guilty rows.

A batch that fails on a row's data is retried row by row, so only the guilty rows end up in
``failed`` and the others are written. Every attempt runs in a SAVEPOINT where the backend asks
for one (PostgreSQL: an error aborts the whole transaction otherwise), rolled back on error, so
a failed key leaves no trace and the caller's transaction stays usable. An error that is not a
row's fault is raised.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from .backends import BatchWrite
from .outcome import WriteOutcome
from .target import Key, KeyIndex, Target

# Errors about the data of a row: retried row by row, reported per key. Anything else (connection
# lost, deadlock, lock timeout, a bad column name) is not a row's fault and is raised.
_ROW_ERRORS = (sa.exc.IntegrityError, sa.exc.DataError, sa.exc.InternalError)


class BatchWriter:
    """Writes the batches of one helper call and collects the per-key outcome."""

    def __init__(self, conn: Connection, target: Target, isolate: bool) -> None:
        self.conn = conn
        self.target = target
        self.isolate = isolate
        self.savepoints = isolate and target.backend.savepoint_per_statement
        self.written: list[Key] = []  # keys as read back from the database
        self.failed: dict[Key, str] = {}

    def write(self, batch: list, write: BatchWrite, key_of: Callable[[Any], Key]) -> None:
        """Write ``batch``; if it fails on a row's data, write its items one by one."""
        try:
            self.written.extend(self._execute(write, batch))
            return
        except _ROW_ERRORS as exc:
            if not self.isolate:
                raise
            if len(batch) == 1:
                self.failed[key_of(batch[0])] = _first_line(exc)
                return
        for item in batch:
            try:
                self.written.extend(self._execute(write, [item]))
            except _ROW_ERRORS as exc:
                self.failed[key_of(item)] = _first_line(exc)

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


def _first_line(exc: sa.exc.DBAPIError) -> str:
    text = str(exc.orig if exc.orig is not None else exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
