"""``update_rows``: a different set of new values for each row, in one statement per batch."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from airflow_keyset_provider.core.errors import ConfigurationError

from .batching import DEFAULT_BATCH_SIZE, as_mapping, check_batch_size, group_by_columns
from .connect import Bind, connection, resolve
from .isolation import BatchWriter
from .outcome import WriteOutcome
from .reflection import TableRef
from .target import Guard


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
        items = [as_mapping(r) for r in rows]
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
