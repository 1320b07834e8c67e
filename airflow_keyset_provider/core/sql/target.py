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

from typing import Any

import sqlalchemy as sa

from ..errors import ConfigurationError
from ..redaction import url_error
from ..row_data import hide_parameters
from . import naming


def make_target_engine(url: Any, name: naming.ConnectionName | None = None) -> sa.Engine:
    """A transactional engine on ``url`` (a URL or its string), with ``hide_parameters`` unless
    row data may be logged, whose connections carry ``name`` (``naming``). An ``Engine`` is used
    as given (its own isolation level, logging settings and connection names)."""
    if isinstance(url, sa.Engine):
        return url
    try:
        engine = sa.create_engine(url, pool_pre_ping=True, hide_parameters=hide_parameters())
    except (sa.exc.ArgumentError, sa.exc.NoSuchModuleError) as exc:
        raise ConfigurationError(
            url_error("target URL", url, exc)
        ) from None  # the cause may quote the password
    if name is not None:
        naming.name_connections(engine, name)
    return engine


__all__ = ["make_target_engine"]
