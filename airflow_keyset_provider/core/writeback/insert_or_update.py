"""``upsert``: insert rows, leaving or updating those that already exist, idempotently."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from airflow_keyset_provider.core.errors import ConfigurationError

from .batching import DEFAULT_BATCH_SIZE, as_mappings, check_batch_size, group_by_columns
from .columns import from_rows
from .connect import Bind, connection, resolve
from .isolation import BatchWriter, ColumnarWriter
from .outcome import WriteOutcome
from .reflection import TableRef
from .target import column_names


def upsert(
    conn: Bind,
    table: TableRef,
    rows: Sequence[Mapping[str, Any]],
    conflict: str | Sequence[str],
    update: Sequence[str] | None = None,
    *,
    key: str | Sequence[str] | None = None,
    batch_size: int = DEFAULT_BATCH_SIZE,
    isolate_failures: bool = True,
) -> WriteOutcome:
    """Insert ``rows``; a row whose ``conflict`` columns already exist is left alone or updated.

    ``conflict`` names the columns of a unique index or constraint. With ``update=None`` (or
    empty) an existing row is kept as it is; otherwise its ``update`` columns take the new values.
    ``applied`` keys were inserted, or updated to different values; ``not_applied`` keys already
    existed and either are kept (``update=None``) or already held exactly these values. So the
    call is idempotent: running it again with the same rows applies nothing.

    Outcomes are keyed by the ``conflict`` columns (scalar for one column, tuple for several),
    or by ``key`` if given (columns present in every row that identify it, e.g. the source key).
    A key must not appear twice. A row conflicting on a *different* unique constraint fails
    (``failed``) with the database's message.
    """
    check_batch_size(batch_size)
    conflict_cols = column_names(conflict, "conflict")
    update_cols = list(update or ())
    with connection(conn) as c:
        target, backend = resolve(c, table, key if key is not None else conflict_cols)
        target.check_columns(conflict_cols, "conflict")
        target.check_columns(update_cols, "update")
        items = as_mappings(rows)
        cols = from_rows(target, items, "upsert")
        if cols is not None:
            target.check_columns(cols.data, "rows")
            _check_carried(cols.data, conflict_cols, update_cols)
            by_columns = backend.columnar_upsert(
                c, target, list(cols.data), conflict_cols, update_cols, isolate_failures
            )
            if by_columns is not None:
                columnar = ColumnarWriter(c, backend, isolate_failures)
                columnar.write(by_columns, cols, batch_size)
                return columnar.outcome(cols)
        keyed = target.key_rows(items, "upsert")
        writer = BatchWriter(c, target, backend, isolate_failures)
        for columns, group in group_by_columns(items):
            target.check_columns(columns, "rows")
            _check_carried(columns, conflict_cols, update_cols)
            plan = backend.upsert(target, list(columns), conflict_cols, update_cols, batch_size)
            for batch in backend.batches(c, group, batch_size, plan):
                writer.write(batch, plan.write, key_of=target.key_of_row)
        return writer.outcome([k for k, _ in keyed])


def _check_carried(
    columns: Iterable[str], conflict_cols: Sequence[str], update_cols: Sequence[str]
) -> None:
    """Every row must carry the conflict columns and the columns to update."""
    given = set(columns)
    missing = [n for n in (*conflict_cols, *update_cols) if n not in given]
    if missing:
        raise ConfigurationError(
            f"upsert rows lack the columns {missing} named in `conflict`/`update`; every "
            "row must carry the conflict columns and the columns to update."
        )
