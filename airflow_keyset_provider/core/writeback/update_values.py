"""``update_rows``: a different set of new values for each row, in one statement per batch."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy.engine import Connection

from airflow_keyset_provider.core.errors import ConfigurationError

from .backends import Backend
from .batching import DEFAULT_BATCH_SIZE, as_mappings, check_batch_size, group_by_columns
from .columns import Columns, from_mapping, from_rows
from .connect import Bind, connection, resolve
from .isolation import BatchWriter, ColumnarWriter
from .outcome import WriteOutcome
from .reflection import TableRef
from .target import Guard, Target


def update_rows(
    conn: Bind,
    table: TableRef,
    key: str | Sequence[str],
    rows: Sequence[Mapping[str, Any]],
    expected: Guard = None,
    *,
    batch_size: int = DEFAULT_BATCH_SIZE,
    isolate_failures: bool = True,
) -> WriteOutcome:
    """Write a different set of values to each row: ``rows`` are ``{key columns..., column: value}``.

    Each mapping names the row by its key column(s); its other entries are the new values of that
    row (rows may set different columns; a column a row does not name is left as it is). A key
    whose row is missing, or does not match ``expected`` (see :func:`guarded_update`), is
    ``not_applied``. Each row is written whole or not at all. ``applied`` means the row matched
    and was written, even if it already held those values. A key must not appear twice.
    """
    check_batch_size(batch_size)
    with connection(conn) as c:
        target, backend = resolve(c, table, key)
        guard = target.guard(expected)
        items = as_mappings(rows)
        cols = from_rows(target, items, "update_rows")
        if cols is not None:
            outcome = _columnar(c, target, backend, cols, expected, batch_size, isolate_failures)
            if outcome is not None:
                return outcome
        keyed = target.key_rows(items, "update_rows")
        writer = BatchWriter(c, target, backend, isolate_failures)
        for columns, group in group_by_columns(items):
            value_cols = [name for name in columns if name not in target.key_names]
            if not value_cols:
                raise ConfigurationError(
                    f"update_rows got rows with only key columns {list(columns)}: nothing to set. "
                    "Add the columns to write to each row mapping."
                )
            target.check_columns(value_cols, "rows")
            plan = backend.update_rows(target, value_cols, guard, expected)
            for batch in backend.batches(c, group, batch_size, plan):
                writer.write(batch, plan.write, key_of=target.key_of_row)
        return writer.outcome([k for k, _ in keyed])


def update_columns(
    conn: Bind,
    table: TableRef,
    key: str | Sequence[str],
    columns: Mapping[str, Sequence[Any]],
    expected: Guard = None,
    *,
    batch_size: int = DEFAULT_BATCH_SIZE,
    isolate_failures: bool = True,
) -> WriteOutcome:
    """:func:`update_rows` with the rows given as columns: ``columns`` maps each key column and
    each column to write to a sequence of values, position i of every sequence being row i.

    Same guarantees and outcome as :func:`update_rows` (keys in the outcome are the key column's
    values, tuples of them for a composite key); it skips building a mapping per row, which is
    most of the Python time of a write of a few columns. Every sequence must have the same
    length; a key must not appear twice.
    """
    check_batch_size(batch_size)
    with connection(conn) as c:
        target, backend = resolve(c, table, key)
        cols = from_mapping(target, columns, "update_columns")
        outcome = _columnar(c, target, backend, cols, expected, batch_size, isolate_failures)
        if outcome is not None:
            return outcome
    names = list(cols.data)
    rows = [
        dict(zip(names, values, strict=True)) for values in zip(*cols.data.values(), strict=True)
    ]
    return update_rows(
        conn, table, key, rows, expected, batch_size=batch_size, isolate_failures=isolate_failures
    )


def _columnar(
    c: Connection,
    target: Target,
    backend: Backend,
    cols: Columns,
    expected: Guard,
    batch_size: int,
    isolate: bool,
) -> WriteOutcome | None:
    """Write ``cols`` by the backend's columnar statement; None if it has none for them."""
    value_cols = [n for n in cols.data if n not in target.key_names]
    if not value_cols:
        raise ConfigurationError(
            f"update_rows got rows with only key columns {list(cols.data)}: nothing to set. "
            "Add the columns to write to each row mapping."
        )
    target.check_columns(value_cols, "rows")
    target.guard(expected)  # its checks (columns exist, a mapping or an expression)
    plan = backend.columnar_update(c, target, value_cols, {}, expected, isolate)
    if plan is None:
        return None
    writer = ColumnarWriter(c, backend, isolate)
    writer.write(plan, cols, batch_size)
    return writer.outcome(cols)
