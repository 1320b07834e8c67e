"""OpenLineage for the plan and traverse tasks: the traversed table as an input dataset.

Used by ``PlanRangesOperator.get_openlineage_facets_on_complete`` and
``TraverseRangeOperator.get_openlineage_facets_on_complete``, which the OpenLineage provider's
listener calls when a task instance succeeds. The dataset is named as the official SQL providers
name it (``DbApiHook.get_openlineage_database_info``): namespace ``postgres://host:port`` (from
the Airflow connection, no credentials), name ``database.schema.table``; an unqualified table is
resolved with the connection's ``current_schema()`` (its ``search_path``). Other sources
(SQLite) report no lineage.

The OpenLineage provider is optional: without it (or when a name cannot be resolved) the methods
return None and nothing else changes; it is imported here, lazily, only when the listener calls.
"""

from __future__ import annotations

import logging
from typing import Any

import sqlalchemy as sa

log = logging.getLogger(__name__)


def table_lineage(source_conn_id: str | None, table: str | None) -> Any:
    """An ``OperatorLineage`` with ``table`` of ``source_conn_id`` as its one input, or None (no
    OpenLineage provider, or the connection or table cannot be named)."""
    try:
        from airflow.providers.common.compat.openlineage.facet import Dataset
        from airflow.providers.openlineage.extractors import OperatorLineage
    except ImportError:
        return None
    if not source_conn_id or not table or "{{" in table:
        return None
    try:
        namespace, name = dataset_name(source_conn_id, table)
    except Exception as exc:  # lineage is best effort: never fail or slow a finished task
        log.warning("OpenLineage: cannot name table %r of %r: %s", table, source_conn_id, exc)
        return None
    return OperatorLineage(inputs=[Dataset(namespace=namespace, name=name)])


def dataset_name(source_conn_id: str, table: str) -> tuple[str, str]:
    """``(namespace, name)`` of ``table`` in the database of ``source_conn_id``."""
    from airflow.sdk import BaseHook

    conn = BaseHook.get_connection(source_conn_id)
    conn_type = (conn.conn_type or "").lower()
    schema, _, name = table.rpartition(".")
    if conn_type in ("postgres", "postgresql"):
        from airflow.providers.postgres.hooks.postgres import PostgresHook

        info = PostgresHook(postgres_conn_id=source_conn_id).get_openlineage_database_info(conn)
        if not schema:
            schema = _current_schema(source_conn_id)
        return f"{info.scheme}://{info.authority}", f"{info.database}.{schema}.{name}"
    raise ValueError(f"connection type {conn.conn_type!r} has no OpenLineage naming here")


def _current_schema(source_conn_id: str) -> str:
    """The schema an unqualified name resolves to on this connection (its ``search_path``)."""
    from .hooks.keyset import KeysetHook

    engine = KeysetHook(source_conn_id).get_conn()
    try:
        with engine.connect() as c:
            return str(c.execute(sa.text("SELECT current_schema()")).scalar_one())
    finally:
        engine.dispose()
