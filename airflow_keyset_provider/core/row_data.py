"""Row data stays out of logs and error texts, unless ``AIRFLOW_KEYSET_LOG_ROW_DATA=1``.

A failing statement's bound parameters are customer row data. SQLAlchemy prints them in a
``StatementError``'s text (``[parameters: ...]``) and, when the ``sqlalchemy.engine`` logger is
at INFO or lower, logs them with every statement, unless the engine has
``hide_parameters=True``. So:

- the engines the project creates (``core.sql.source.make_engine``, hence
  ``KeysetHook.get_conn``) are made with ``hide_parameters=True``;
- every SQLAlchemy error that leaves a write-back helper has its parameters hidden, whatever
  the engine (``[SQL parameters hidden due to hide_parameters=True]``);
- the reason stored per failed key is the database's primary message only (PostgreSQL's
  ``diag.message_primary``, SQLite's message), never the statement, its parameters or the
  ``DETAIL`` line (which quotes the row: ``Failing row contains (...)``).

``AIRFLOW_KEYSET_LOG_ROW_DATA=1`` (or ``true``/``yes``/``on``), read when an engine is made or an
error is raised, turns the first two off, for debugging on data that may appear in logs.
"""

from __future__ import annotations

import os

import sqlalchemy as sa

LOG_ROW_DATA_ENV = "AIRFLOW_KEYSET_LOG_ROW_DATA"


def log_row_data() -> bool:
    """Has the operator asked for row data in logs (``AIRFLOW_KEYSET_LOG_ROW_DATA=1``)?"""
    return os.environ.get(LOG_ROW_DATA_ENV, "").strip().lower() in {"1", "true", "yes", "on"}


def hide_parameters() -> bool:
    """The ``hide_parameters`` to create engines with: True unless row data may be logged."""
    return not log_row_data()


def redact(exc: sa.exc.StatementError) -> None:
    """Hide ``exc``'s bound parameters from its text (they stay in ``exc.params``)."""
    if hide_parameters():
        exc.hide_parameters = True
