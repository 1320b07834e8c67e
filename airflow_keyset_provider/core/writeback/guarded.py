"""``guarded_update``: the same new values on many rows, each only if it is still as expected."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from airflow_keyset_provider.core.errors import ConfigurationError

from .batching import DEFAULT_BATCH_SIZE, check_batch_size
from .columns import from_keys
from .connect import Bind, connection, resolve
from .isolation import BatchWriter, ColumnarWriter
from .outcome import WriteOutcome
from .reflection import TableRef
from .target import Guard, Key


def guarded_update(
    conn: Bind,
    table: TableRef,
    key: str | Sequence[str],
    keys: Iterable[Key],
    values: Mapping[str, Any],
    expected: Guard = None,
    *,
    batch_size: int = DEFAULT_BATCH_SIZE,
    isolate_failures: bool = True,
) -> WriteOutcome:
    """Set the same ``values`` on the rows of ``keys`` whose columns still equal ``expected``.

    The guard is what makes a batch safe against concurrent writers: a row that another process
    moved on (``expected={"status": "PENDING"}`` no longer true) keeps its state and its key is
    ``not_applied``, as is a key with no row. The check and the write are one atomic step per
    row, so two callers racing for the same row never both get it ``applied``. With a guard that
    the new values no longer satisfy, the call is idempotent: a second run applies nothing.

    ``values`` maps column names to Python values or SQL expressions (``sa.func.now()``);
    ``expected`` maps column names to values (``None`` means IS NULL), or is any boolean
    SQLAlchemy expression on the table, or ``None`` for no guard. ``keys`` are scalars for a
    one-column ``key`` and tuples for a composite one; duplicates are written once.
    """
    check_batch_size(batch_size)
    if not values:
        raise ConfigurationError("guarded_update needs at least one column in `values`.")
    with connection(conn) as c:
        target, backend = resolve(c, table, key)
        target.check_columns(values, "values")
        guard = target.guard(expected)  # its checks first (columns exist)
        plan_c = backend.columnar_update(c, target, (), values, expected, isolate_failures)
        if plan_c is not None:
            cols = from_keys(target, keys)
            columnar = ColumnarWriter(c, backend, isolate_failures)
            columnar.write(plan_c, cols, batch_size)
            return columnar.outcome(cols)
        wanted = target.normalize_keys(keys)
        plan = backend.guarded_update(target, values, guard, expected)
        writer = BatchWriter(c, target, backend, isolate_failures)
        for batch in backend.batches(c, wanted, batch_size, plan):
            writer.write(batch, plan.write, key_of=lambda k: k)
        return writer.outcome(wanted)
