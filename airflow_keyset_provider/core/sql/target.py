"""The target database: where a processor writes, through a transaction the engine opens.

``make_target_engine`` builds the engine of ``KeysetTraversal(target_url=...)`` (the operator's
``target_conn_id``). Unlike the source's engine (autocommit: a traversal never holds a snapshot
open between chunks), the target's is transactional: the run begins one transaction per
processor call, hands its ``Connection`` to the processor as ``chunk.connection``, commits it
when the processor returns and rolls it back when it raises (``core/run/commits.py``
``call_processor``). Its bound parameters are hidden from logs and error texts (customer row
data) unless ``AIRFLOW_KEYSET_LOG_ROW_DATA=1``.
"""

from __future__ import annotations

import os
from typing import Any

import sqlalchemy as sa

from ..errors import ConfigurationError

#: Set to 1 (true, yes, on) to let SQLAlchemy print bound parameters, for debugging only.
LOG_ROW_DATA_ENV = "AIRFLOW_KEYSET_LOG_ROW_DATA"


def log_row_data() -> bool:
    """Has the operator asked for row data in logs (``AIRFLOW_KEYSET_LOG_ROW_DATA=1``)?"""
    return os.environ.get(LOG_ROW_DATA_ENV, "").strip().lower() in {"1", "true", "yes", "on"}


def make_target_engine(url: Any) -> sa.Engine:
    """A transactional engine on ``url`` (a URL or its string), with ``hide_parameters`` unless
    row data may be logged. An ``Engine`` is used as given (its own isolation level and logging
    settings)."""
    if isinstance(url, sa.Engine):
        return url
    try:
        return sa.create_engine(url, pool_pre_ping=True, hide_parameters=not log_row_data())
    except (sa.exc.ArgumentError, sa.exc.NoSuchModuleError) as exc:
        raise ConfigurationError(f"target URL is not usable: {exc}") from exc


__all__ = ["LOG_ROW_DATA_ENV", "log_row_data", "make_target_engine"]
