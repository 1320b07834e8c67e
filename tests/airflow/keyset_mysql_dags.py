"""The DAG of the MariaDB test (``test_keyset_mysql.py``): plan -> traverse -> barrier with every
SQL connection of type ``mysql`` (source, checkpoint mirror, processor target). Linked into the
throwaway DAGs folder by conftest.py; the connection comes from ``AIRFLOW_CONN_KEYSET_MYSQL_DB``.
"""

from __future__ import annotations

import datetime as dt

import sqlalchemy as sa
from airflow.sdk import DAG
from keyset_examples_common import KEY_PREFIX, REDIS_CONN_ID
from sqlalchemy.dialects import mysql

from airflow_keyset_provider import BarrierSensor, Chunk, PlanRangesOperator, TraverseRangeOperator

MYSQL_CONN_ID = "keyset_mysql_db"
OUTBOX = sa.Table(
    "kt_outbox",
    sa.MetaData(),
    sa.Column("event_seq", sa.BigInteger, primary_key=True, autoincrement=False),
    sa.Column("payload", sa.String(100), nullable=False),
)


def copy_to_outbox(chunk: Chunk) -> None:
    """Copy the chunk's events into the outbox in the engine's transaction (``chunk.connection``
    on ``target_conn_id``); ``INSERT IGNORE`` keeps a replayed chunk idempotent."""
    rows = [{"event_seq": r["seq"], "payload": r["payload"]} for r in chunk.rows]
    chunk.connection.execute(mysql.insert(OUTBOX).prefix_with("IGNORE"), rows)


with DAG(
    "kt_mysql_redispatch",
    schedule=None,
    start_date=dt.datetime(2024, 1, 1, tzinfo=dt.UTC),
    catchup=False,
    max_active_runs=1,
) as kt_mysql_redispatch:
    plan = PlanRangesOperator(
        task_id="plan",
        source_conn_id=MYSQL_CONN_ID,
        checkpoint_conn_id=MYSQL_CONN_ID,
        table="kt_events",
        key="seq",
        columns=["payload"],
        redis_conn_id=REDIS_CONN_ID,
        key_prefix=KEY_PREFIX,
        max_ranges=3,
    )
    traverse = TraverseRangeOperator.partial(
        task_id="traverse",
        processor=copy_to_outbox,
        redis_conn_id=REDIS_CONN_ID,
        target_conn_id=MYSQL_CONN_ID,
        chunk_size=40,
    ).expand_kwargs(plan.output)
    barrier = BarrierSensor(
        task_id="barrier",
        plan_task_id="plan",
        redis_conn_id=REDIS_CONN_ID,
        poke_interval=0.5,
        timeout=60,
    )
    plan >> traverse >> barrier
