"""Whose fault a database error is: the row's data, the dependency, or the configuration.

Every write-back helper asks this module, and acts on the answer the same way:

- ``ROW``: this row's data made the write fail. The batch is retried row by row and the key is
  reported in ``WriteOutcome.failed`` with the database's message (or the error is raised as is
  with ``isolate_failures=False``). The engine retries such a key, then dead-letters it.
- ``DEPENDENCY``: the database is unavailable or refused for a reason that passes (connection
  lost, timeout, lock not available, serialization failure, deadlock, shutdown, out of
  resources). Raised as :class:`~airflow_keyset_provider.core.errors.RetryableError` (the driver's
  error as its cause): the engine keeps the cursor, backs off and reads the chunk again.
- ``CONFIGURATION``: the statement can never work as written (undefined table or column, missing
  privilege, syntax, a read-only transaction), or the error is not known to be one of the
  above. Raised as it is (the SQLAlchemy error), so a human sees it; nothing is blamed on rows.

PostgreSQL (psycopg2: ``exc.orig.pgcode``, psycopg 3: ``exc.orig.sqlstate``) is classified by
SQLSTATE, first by the exact code, then by its two-character class:

=========  =====================================================  ==============
SQLSTATE   meaning                                                fault
=========  =====================================================  ==============
``09``     triggered action exception                             ROW
``20``     case not found (PL/pgSQL ``CASE`` without ``ELSE``)    ROW
``21``     cardinality violation (a subquery gave several rows)   ROW
``22``     data exception (value too long, bad input, division)   ROW
``23``     integrity constraint violation (CHECK, FK, NOT NULL)   ROW
``27``     triggered data change violation                        ROW
``44``     WITH CHECK OPTION violation                            ROW
``54000``  program limit exceeded (e.g. index row too large)      ROW
``P0``     PL/pgSQL: ``RAISE EXCEPTION`` (P0001), ``ASSERT``       ROW
``08``     connection exception                                   DEPENDENCY
``40``     transaction rollback (40001 serialization, 40P01       DEPENDENCY
           deadlock)
``53``     insufficient resources (disk full, out of memory,      DEPENDENCY
           too many connections)
``55P03``  lock not available (``lock_timeout``)                  DEPENDENCY
``55006``  object in use                                          DEPENDENCY
``57``     operator intervention (``statement_timeout`` 57014,    DEPENDENCY
           admin shutdown 57P01, cannot connect now 57P03)
``58``     system error (I/O error)                               DEPENDENCY
``72``     snapshot too old                                       DEPENDENCY
``42``     syntax error or access rule violation (42P01           CONFIGURATION
           undefined table, 42703 undefined column, 42501
           insufficient privilege)
other      (``0A`` feature not supported, ``25`` transaction       CONFIGURATION
           state, ``55`` prerequisite state, ``XX`` internal)
=========  =====================================================  ==============

An error whose connection SQLAlchemy found broken (``exc.connection_invalidated``) is a
DEPENDENCY whatever its code. SQLite has no SQLSTATE: its DB-API exception class decides, as it
always did: ``IntegrityError``, ``DataError`` and ``InternalError`` are ROW (SQLite reports
CHECK, NOT NULL, UNIQUE and a trigger's ``RAISE(ABORT, ...)`` as ``IntegrityError``), anything
else (``OperationalError``: no such table, database is locked) is CONFIGURATION.

A database family with numbered errors instead (MySQL/MariaDB: ``exc.orig.args[0]``) gives its
backend an ``error_numbers`` table (``{number: Fault}``) that :func:`fault_of` consults first
(before the SQLSTATE, which PyMySQL >= 1.1 also gives, and the exception class); ``backends/mysql.py`` has the full table:

==================================================================  ==============
MySQL/MariaDB error number                                          fault
==================================================================  ==============
1048 NOT NULL, 1062 duplicate entry, 1264 out of range, 1265 data    ROW
truncated, 1292/1366 incorrect value, 1364 no default, 1365
division by 0, 1406 data too long, 1451/1452 (1216/1217) foreign
key, 1690 out of range, 3819 CHECK (MySQL), 4025 CHECK (MariaDB),
1644 ``SIGNAL`` (SQLSTATE 45000, e.g. from a trigger)
1205 lock wait timeout, 1213 deadlock, 1040 too many connections,    DEPENDENCY
1053 shutdown, 1317 query interrupted, 1969 ``max_statement_time``
(MariaDB), 3024 ``max_execution_time`` (MySQL), 2002/2003 cannot
connect, 2006 server gone away, 2013 lost connection
1146 no such table, 1054 unknown column, 1142/1143 denied, 1064       CONFIGURATION
syntax, 1153 packet too large, 1792 read-only transaction
other numbers                                                       by DB-API class
==================================================================  ==============

The data errors are errors only in a strict ``sql_mode`` (``STRICT_TRANS_TABLES``, the default
since MySQL 5.7 and MariaDB 10.2.4); otherwise the server stores a truncated value and warns, so
the MySQL backend refuses a connection without one.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping

import sqlalchemy as sa

from airflow_keyset_provider.core.errors import RetryableError

from ..db_reasons import describe, error_number, sqlstate


class Fault(enum.Enum):
    """Whose fault a database error is (see the module docstring for what each one does)."""

    ROW = "row"
    DEPENDENCY = "dependency"
    CONFIGURATION = "configuration"


_ROW, _DEP, _CONF = Fault.ROW, Fault.DEPENDENCY, Fault.CONFIGURATION

#: Exact SQLSTATEs that differ from their class.
SQLSTATE_CODES: Mapping[str, Fault] = {"54000": _ROW, "55P03": _DEP, "55006": _DEP}
#: SQLSTATE classes (first two characters); a class not listed is CONFIGURATION.
SQLSTATE_CLASSES: Mapping[str, Fault] = {
    **dict.fromkeys(("09", "20", "21", "22", "23", "27", "44", "P0"), _ROW),
    **dict.fromkeys(("08", "40", "53", "57", "58", "72"), _DEP),
}
# The DB-API classes of a row's fault for drivers without codes (SQLite).
_ROW_CLASSES = (sa.exc.IntegrityError, sa.exc.DataError, sa.exc.InternalError)


def by_sqlstate(code: str) -> Fault:
    """The fault of a SQLSTATE, by exact code, then by class, else CONFIGURATION."""
    code = code.upper()
    found = SQLSTATE_CODES.get(code) or SQLSTATE_CLASSES.get(code[:2])
    return found or _CONF


def fault_of(exc: sa.exc.DBAPIError, error_numbers: Mapping[int, Fault] | None = None) -> Fault:
    """Classify a database error raised by a write (see the module docstring)."""
    if exc.connection_invalidated:
        return _DEP
    number = error_number(exc)  # MySQL's numbers first: PyMySQL >= 1.1 also has a sqlstate,
    if error_numbers and number is not None and number in error_numbers:  # 45000 for SIGNAL
        return error_numbers[number]
    code = sqlstate(exc)
    if code is not None:
        return by_sqlstate(code)
    return _ROW if isinstance(exc, _ROW_CLASSES) else _CONF


def dependency_error(exc: sa.exc.DBAPIError) -> RetryableError:
    """The ``RetryableError`` to raise (``from exc``) for a DEPENDENCY fault."""
    return RetryableError(f"write-back: the database failed: {describe(exc)}")
