"""Batch write-back for processors: one round trip per batch, an outcome per key.

A processor gets a chunk of up to thousands of keys and usually writes something back for each
of them. One UPDATE per row costs a round trip per row (3.3k rows/s measured here); the helpers
below write a whole batch with one statement and still say, key by key, what happened:

- ``applied``: the statement wrote this key's row (updated it, or inserted it);
- ``not_applied``: the statement ran and left the row alone: the row does not exist, its guard
  (``expected``) did not match because another writer got there first, or the upsert found the
  row already as wanted. Re-running the write for such a key would change nothing;
- ``failed``: writing this key raised a database error of its own (CHECK, foreign key, NOT NULL,
  value too long, a trigger's RAISE). Other keys of the batch are not held back by it.

``WriteOutcome.to_chunk_result()`` turns that into the processor's ``ChunkResult``: failed keys are
retried later by the engine, not-applied keys count as skipped.

Transactions: ``conn`` is a SQLAlchemy ``Connection`` whose transaction the caller owns. Every
write of a call happens inside it, so the caller's rollback undoes all of them and the caller's
commit makes them durable; the helpers never commit. Given an ``Engine`` instead, a call runs in a
transaction of its own that commits when the call returns. A ``failed`` key leaves no trace, and
an applied key's row got all of its new values: a row is never half written. An error that is not
about a row's data is raised, not reported per key: a dependency failure (lost connection,
deadlock, lock or statement timeout) as ``RetryableError``, a configuration error (undefined
table, missing privilege) as it is; ``failures.py`` holds the rules, by SQLSTATE on PostgreSQL,
by error number on MySQL/MariaDB.
With ``isolate_failures=True`` (the default) the caller's transaction is still usable after it,
the helper's own partial writes of that call undone only if the caller rolls back.

The hot path (``direct.py``, ``columns.py``, ``isolation.ColumnarWriter``): a call's rows become
one list per column, and each batch is one statement compiled once per shape and run on the
driver's cursor of the caller's connection, its outcome read back as positions. PostgreSQL:
``UPDATE ... FROM unnest(%s::T[], ...) WITH ORDINALITY ... RETURNING`` the position, in a
savepoint sent in the same round trip; MySQL/MariaDB: a locking read and one ``UPDATE`` /
``UPDATE ... JOIN`` / ``INSERT ... ON DUPLICATE KEY UPDATE``, no savepoint (InnoDB rolls a failed
statement back alone). A batch that fails on a row's data is written again in halves. Types with
a Python bind processor, guard expressions and SQL-expression values take the row path below.
``update_columns`` takes the columns directly (no mapping per row).

Tables are ``sqlalchemy.Table`` objects or names (``"name"`` or ``"schema.name"``), reflected once
per engine and name. Identifiers are quoted by SQLAlchemy and every value is a bound parameter.
Supported databases: PostgreSQL (psycopg2, psycopg 3), SQLite >= 3.35 (``RETURNING``), MariaDB
>= 10.6 and MySQL >= 8.0 (PyMySQL; no ``UPDATE ... RETURNING``: each batch locks the rows it
writes first, see ``backends/mysql.py``). Older servers are refused; tested on MariaDB 10.11
(docs/mysql.md says what is tested and what is stated from the documentation).

The four helpers are one concept, "write a batch back and say what happened to each key"; the
package keeps one module per helper and one per shared piece:

- ``guarded.py`` (:func:`guarded_update`), ``update_values.py`` (:func:`update_rows`,
  :func:`update_columns`),
  ``insert_or_update.py`` (:func:`upsert`), ``claim.py`` (:func:`claim_skip_locked`);
- ``outcome.py``: :class:`WriteOutcome`;
- ``target.py``: the table and its key, pure data (it imports no backend); ``connect.py``: the
  call's connection and ``resolve``, which pairs the target with its database's backend;
  ``reflection.py``: tables passed by name, reflected once per engine (:func:`clear_table_cache`);
- ``isolation.py``: runs the batches and retries a batch that failed on a row's data row by
  row; ``failures.py``: whose fault a database error is (row, dependency, configuration);
  ``row_data.py``: no bound parameters in logs or error texts (``AIRFLOW_KEYSET_LOG_ROW_DATA``);
  ``batching.py``: input checks and batch splitting;
- ``backends/``: what differs per database (``base.py`` is the interface, ``postgresql.py``,
  ``sqlite.py`` and ``mysql.py`` implement it; ``case_when.py`` and ``on_conflict.py`` are
  statement shapes they share). Adding a database family is adding a module there. Imports go one way, helpers ->
  ``connect`` -> ``backends`` -> ``target``, with no cycle (``tests/core/writeback/test_writeback_imports.py``).

Example, in a processor::

    def cancel_expired(chunk: Chunk) -> ChunkResult:
        with engine.begin() as conn:
            outcome = guarded_update(conn, "orders", "id", chunk.keys,
                                     values={"status": "CANCELLED"},
                                     expected={"status": "PENDING"})
        return outcome.to_chunk_result()   # orders paid meanwhile are skipped, not overwritten
"""

from .batching import DEFAULT_BATCH_SIZE
from .claim import claim_skip_locked
from .guarded import guarded_update
from .insert_or_update import upsert
from .outcome import WriteOutcome
from .reflection import clear_table_cache
from .update_values import update_columns, update_rows

__all__ = [
    "DEFAULT_BATCH_SIZE",
    "WriteOutcome",
    "claim_skip_locked",
    "clear_table_cache",
    "guarded_update",
    "update_columns",
    "update_rows",
    "upsert",
]
