"""``claim_skip_locked``: take rows to work on that no concurrent worker holds."""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine, Row

from airflow_keyset_provider.core.errors import ConfigurationError

from .connect import connection, resolve
from .reflection import TableRef
from .target import Guard


def claim_skip_locked(
    conn: Connection,
    table: TableRef,
    key: str | Sequence[str],
    where: Guard,
    limit: int,
    columns: Sequence[str] | None = None,
) -> list[Row]:
    """Lock and return up to ``limit`` rows matching ``where``, lowest keys first, skipping rows
    that another transaction holds.

    On PostgreSQL the rows stay locked until the caller's transaction ends, so concurrent workers
    calling this get disjoint rows and never wait for each other; mark them (e.g. with
    :func:`guarded_update`) in the same transaction. Under REPEATABLE READ or SERIALIZABLE a row
    changed since the snapshot raises a serialization error; use READ COMMITTED.

    On SQLite, which has one writer at a time, this is a plain ordered ``SELECT``: the exclusion
    comes from the database lock that the caller's first write takes, not from this call.

    ``where`` is ``{column: value}`` (equality, ``None`` = IS NULL), a boolean SQLAlchemy
    expression on the table, or ``None``. ``columns`` are the columns to return (default: all).
    A dependency failure (lost connection, lock or statement timeout) raises ``RetryableError``;
    any other database error is raised as it is.
    """
    if isinstance(conn, Engine):
        raise ConfigurationError(
            "claim_skip_locked needs a Connection with an open transaction, not an Engine: the "
            "claimed rows stay locked only until that transaction ends. Use "
            "`with engine.begin() as conn:` and do the claim and the writes inside it."
        )
    if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
        raise ConfigurationError(f"limit must be a positive int, got {limit!r}.")
    with connection(conn) as c:
        target, backend = resolve(c, table, key)
        if columns is None:
            stmt = sa.select(target.table)
        else:
            target.check_columns(columns, "columns")
            stmt = sa.select(*(target.table.c[name] for name in columns))
        guard = target.guard(where)
        if guard is not None:
            stmt = stmt.where(guard)
        stmt = stmt.order_by(*target.key_cols).limit(limit)
        return list(c.execute(backend.lock_for_claim(stmt)).all())
