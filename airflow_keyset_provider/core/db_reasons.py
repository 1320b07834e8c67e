"""The reason a failed write gives, without the row's data: class, constraint, column.

A database's own message often quotes the value that failed (PostgreSQL: ``invalid input
syntax for type integer: "<value>"``, MariaDB: ``Duplicate entry '<value>' for key ...``, any
trigger's ``RAISE``/``SIGNAL`` text), and that message would reach the log, the dead letters,
the page and the CLI. So the reason of a failed key, and the text of a ``RetryableError`` the
helpers raise, is built from what names no value:

- **PostgreSQL** (psycopg2 ``pgcode``, psycopg 3 ``sqlstate``): the SQLSTATE, its condition name
  (the driver's exception class: ``UniqueViolation`` -> ``unique_violation``), a phrase for the
  common ones, and the diagnostics fields that hold *names* only: ``constraint_name``,
  ``column_name``, ``table_name``, ``datatype_name``;
- **MySQL/MariaDB** (PyMySQL, mysqlclient: ``args[0]``): the error number, a phrase, and the
  constraint or column parsed from the *end* of the message (where the server puts the name, after
  any quoted value), kept only if it is an identifier;
- **SQLite**: the DB-API class and, for its constraint messages (``CHECK constraint failed:
  name``, ``UNIQUE``, ``NOT NULL``, ``FOREIGN KEY``), the kind and the names it gives; any other
  SQLite message (a trigger's ``RAISE(ABORT, ...)`` text) and any other driver: the class only.

Example: ``unique_violation (SQLSTATE 23505): unique constraint violated; constraint
dst_email_key, table dst``. The server's full message (first line) is given instead only with the
existing opt-in for row data in logs, ``AIRFLOW_KEYSET_LOG_ROW_DATA=1`` (``core/row_data.py``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import sqlalchemy as sa

from .row_data import LOG_ROW_DATA_ENV, log_row_data

#: A phrase per SQLSTATE (PostgreSQL) for the errors a row's data causes most.
SQLSTATE_PHRASES: Mapping[str, str] = {
    "22001": "value too long for the column's type",
    "22003": "numeric value out of range",
    "22007": "invalid date/time format",
    "22008": "date/time value out of range",
    "22012": "division by zero",
    "22P02": "invalid input syntax for the column's type",
    "23502": "NOT NULL violated",
    "23503": "foreign key violated",
    "23505": "unique constraint violated",
    "23514": "CHECK constraint violated",
    "23P01": "exclusion constraint violated",
    "P0001": "raised by a trigger or function (RAISE EXCEPTION)",
    "P0004": "assertion failed in a trigger or function (ASSERT)",
    "45000": "raised by a trigger or procedure (SIGNAL)",
}
#: A phrase per MySQL/MariaDB error number (the ones ``backends/mysql.py`` calls a row's fault).
MYSQL_PHRASES: Mapping[int, str] = {
    1048: "NOT NULL violated",
    1062: "Duplicate entry for a unique key",
    1216: "foreign key violated",
    1217: "foreign key violated (the row is referenced)",
    1264: "numeric value out of range",
    1265: "data truncated",
    1292: "incorrect value for the column's type",
    1366: "incorrect value for the column's type",
    1364: "no value and no default",
    1365: "division by zero",
    1406: "value too long for the column",
    1451: "foreign key violated (the row is referenced)",
    1452: "foreign key violated",
    1690: "value out of range",
    3819: "CHECK constraint violated",
    4025: "CHECK constraint violated",
    1644: "raised by a trigger or procedure (SIGNAL)",
}
#: Names in MySQL/MariaDB messages, each anchored at the end (after any quoted value).
_MYSQL_NAMES: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("constraint", re.compile(r"for key '([^']*)'\Z")),  # 1062
    (
        "constraint",
        re.compile(
            r"CONSTRAINT `([^`]*)` FOREIGN KEY \(`([^`]*)`\) REFERENCES [^()]*\([^()]*\)\)\Z"
        ),
    ),
    ("constraint", re.compile(r"CONSTRAINT `([^`]*)` failed for `[^`]*`\.`[^`]*`\Z")),  # 4025
    ("constraint", re.compile(r"\ACheck constraint '([^']*)' is violated\.\Z")),  # 3819
    ("column", re.compile(r"for column (?:`[^`]*`\.)*[`']([^`']*)[`'] at row \d+\Z")),
    ("column", re.compile(r"\AColumn '([^']*)' cannot be null\Z")),  # 1048
    ("column", re.compile(r"\AField '([^']*)' doesn't have a default value\Z")),  # 1364
)
_SQLITE_CONSTRAINT = re.compile(
    r"(CHECK|UNIQUE|NOT NULL|FOREIGN KEY|PRIMARY KEY) constraint failed(?:: ([A-Za-z0-9_$., ]+))?"
)
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_$.,]{0,255}")
_GENERIC = {
    "Error",
    "DatabaseError",
    "DataError",
    "IntegrityError",
    "InternalError",
    "OperationalError",
    "ProgrammingError",
    "NotSupportedError",
    "InterfaceError",
}
WITHHELD = (
    f"(the database's message is withheld: it may quote row data; {LOG_ROW_DATA_ENV}=1 shows it)"
)


def sqlstate(exc: sa.exc.DBAPIError) -> str | None:
    """The SQLSTATE of the driver's error: ``sqlstate`` (psycopg 3), ``pgcode`` (psycopg2)."""
    orig = exc.orig
    code = getattr(orig, "sqlstate", None) or getattr(orig, "pgcode", None)
    return code if isinstance(code, str) and len(code) == 5 else None


def error_number(exc: sa.exc.DBAPIError) -> int | None:
    """The driver's error number (MySQL/MariaDB drivers: ``exc.orig.args[0]``), if any."""
    args = getattr(exc.orig, "args", ())
    number = args[0] if args else None
    return number if isinstance(number, int) and not isinstance(number, bool) else None


def describe(exc: sa.exc.DBAPIError) -> str:
    """The reason to report for a database error (module docstring): never a value unless
    ``AIRFLOW_KEYSET_LOG_ROW_DATA=1``."""
    return safe_reason(exc.orig, sqlstate(exc), error_number(exc))


def describe_exception(exc: BaseException) -> str:
    """``Type: message`` for an error a processor raised; a database error (``DBAPIError``,
    also as the cause of another) by :func:`describe` instead, so its text, which quotes values
    and the statement, stays out of dead letters and logs."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, sa.exc.DBAPIError):
            return f"{type(seen).__name__}: {describe(seen)}"
        seen = seen.__cause__ or seen.__context__
        if seen is exc:
            break
    return f"{type(exc).__name__}: {exc}"


def safe_reason(orig: Any, sqlstate: str | None, number: int | None) -> str:
    """The reason for the driver's error ``orig`` (``exc.orig``) with its SQLSTATE and MySQL
    error number (``failures.sqlstate``, ``failures.error_number``): see the module docstring.
    With ``AIRFLOW_KEYSET_LOG_ROW_DATA=1``, the server's message (first line) instead."""
    if log_row_data():
        return server_message(orig, number)
    names: dict[str, str] = {}
    if number is not None:
        head = f"MySQL error {number}"
        phrase = MYSQL_PHRASES.get(number)
        names.update(_mysql_names(_mysql_message(orig)))
    elif sqlstate is not None:
        condition = _condition(orig)
        head = f"{condition} (SQLSTATE {sqlstate})" if condition else f"SQLSTATE {sqlstate}"
        phrase = SQLSTATE_PHRASES.get(sqlstate.upper())
        names.update(_pg_names(orig))
    else:
        head, phrase = type(orig).__name__, None
        sqlite = _SQLITE_CONSTRAINT.fullmatch(str(orig or "").strip())
        if sqlite is not None:  # SQLite's constraint messages name the constraint, no value
            phrase = f"{sqlite.group(1)} constraint failed"
            names["constraint"] = (sqlite.group(2) or "").replace(", ", ",")
    text = head + (f": {phrase}" if phrase else "")
    shown = [f"{k} {v}" for k, v in names.items() if v and _IDENTIFIER.fullmatch(v)]
    return text + ("; " + ", ".join(shown) if shown else "") + " " + WITHHELD


def server_message(orig: Any, number: int | None) -> str:
    """The database's own primary message, one line (only with the row-data opt-in): never the
    statement, its parameters or PostgreSQL's DETAIL line."""
    primary = getattr(getattr(orig, "diag", None), "message_primary", None)  # both psycopgs
    if primary is None and number is not None:
        primary = _mysql_message(orig)
    text = primary if isinstance(primary, str) and primary.strip() else str(orig or "")
    lines = text.strip().splitlines()
    return lines[0] if lines else type(orig).__name__


def _condition(orig: Any) -> str | None:
    """``unique_violation`` from the driver's class ``UniqueViolation`` (None if generic)."""
    name = type(orig).__name__
    if name in _GENERIC:
        return None
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name).lower()


def _pg_names(orig: Any) -> dict[str, str]:
    diag = getattr(orig, "diag", None)
    out = {}
    for field, label in (
        ("constraint_name", "constraint"),
        ("column_name", "column"),
        ("table_name", "table"),
        ("datatype_name", "type"),
    ):
        value = getattr(diag, field, None)
        if isinstance(value, str):
            out[label] = value
    return out


def _mysql_message(orig: Any) -> str:
    args: tuple[Any, ...] = tuple(getattr(orig, "args", ()))
    return args[1] if len(args) > 1 and isinstance(args[1], str) else ""


def _mysql_names(message: str) -> dict[str, str]:
    message = message.strip()
    out: dict[str, str] = {}
    for label, pattern in _MYSQL_NAMES:
        found = pattern.search(message)
        if found is None or label in out:
            continue
        out[label] = found.group(1)
        if found.lastindex and found.lastindex > 1:  # a foreign key names its column too
            out["column"] = found.group(2)
    return out


__all__ = [
    "MYSQL_PHRASES",
    "SQLSTATE_PHRASES",
    "WITHHELD",
    "describe",
    "describe_exception",
    "error_number",
    "safe_reason",
    "server_message",
    "sqlstate",
]
