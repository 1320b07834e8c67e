"""The DAGs of ``test_verify.py``: rounds with ``verify`` (no row of the round still matches
``status = 'open'`` once it closed) over ``kt_orders`` of the connection ``kt_verify_db`` (the test
points it at PostgreSQL or MariaDB). The processor cancels each chunk's orders in the engine's
transaction; when it reaches the last order (``LAST``) it also puts the orders listed in
``kt_reopen`` back to ``open``: rows changed behind the traversal's back after their chunk was
processed. Linked into the throwaway DAGs folder by conftest.py."""

from __future__ import annotations

import datetime as dt

import sqlalchemy as sa
from airflow.sdk import DAG, Context, task
from keyset_examples_common import KEY_PREFIX, REDIS_CONN_ID

from airflow_keyset_provider import (
    BarrierSensor,
    Chunk,
    PlanRangesOperator,
    TraverseRangeOperator,
    stream_asset,
)

CONN_ID = "kt_verify_db"
LAST = 300  # the test's orders are 1..LAST
VERIFY = "status = 'open'"
START = dt.datetime(2024, 1, 1, tzinfo=dt.UTC)
FAILURES: dict[str, str] = {}  # task id -> the exception it failed with


def record_failure(context: Context) -> None:
    FAILURES[context["ti"].task_id] = (
        f"{type(context.get('exception')).__name__}: {context.get('exception')}"
    )


def cancel_orders(chunk: Chunk) -> None:
    keys = list(chunk.keys)
    chunk.connection.execute(
        sa.text("UPDATE kt_orders SET status = 'cancelled' WHERE id IN :ids").bindparams(
            sa.bindparam("ids", expanding=True)
        ),
        {"ids": keys},
    )
    if LAST in keys:  # another writer, behind the traversal's back
        chunk.connection.execute(
            sa.text("UPDATE kt_orders SET status = 'open' WHERE id IN (SELECT id FROM kt_reopen)")
        )


@task.keyset_traverse(target_conn_id=CONN_ID, chunk_size=50, redis_conn_id=REDIS_CONN_ID)
def cancel_open(chunk: Chunk) -> None:
    cancel_orders(chunk)


# The decorator: verify, and repair what still matches through the same function once.
with DAG("kt_verify_repair", schedule=None, start_date=START, catchup=False) as kt_verify_repair:
    cancel_open.round(
        source_conn_id=CONN_ID,
        table="kt_orders",
        key="id",
        key_prefix=KEY_PREFIX,
        max_ranges=3,
        verify=VERIFY,
        on_verify_failure="repair",
        verify_keys=2,
        outlets=[stream_asset("kt_verify_repair")],
    )

# The operators: a failed verification fails the barrier with the count and the keys.
with DAG("kt_verify_fail", schedule=None, start_date=START, catchup=False) as kt_verify_fail:
    plan = PlanRangesOperator(
        task_id="plan",
        source_conn_id=CONN_ID,
        table="kt_orders",
        key="id",
        redis_conn_id=REDIS_CONN_ID,
        key_prefix=KEY_PREFIX,
        max_ranges=3,
        verify=VERIFY,
    )
    traverse = TraverseRangeOperator.partial(
        task_id="traverse",
        processor=cancel_orders,
        redis_conn_id=REDIS_CONN_ID,
        target_conn_id=CONN_ID,
        chunk_size=50,
    ).expand_kwargs(plan.output)
    barrier = BarrierSensor(
        task_id="barrier",
        plan_task_id="plan",
        redis_conn_id=REDIS_CONN_ID,
        deferrable=True,
        poke_interval=0.5,
        timeout=60,
        on_failure_callback=record_failure,
    )
    plan >> traverse >> barrier

# The deferrable barrier that waits in its trigger while the round is traversed elsewhere (the
# test's thread), then verifies and repairs in execute_complete.
with DAG("kt_verify_defer", schedule=None, start_date=START, catchup=False) as kt_verify_defer:
    PlanRangesOperator(
        task_id="plan",
        source_conn_id=CONN_ID,
        table="kt_orders",
        key="id",
        redis_conn_id=REDIS_CONN_ID,
        key_prefix=KEY_PREFIX,
        max_ranges=3,
        verify=VERIFY,
        on_verify_failure="repair",
    ) >> BarrierSensor(
        task_id="barrier",
        plan_task_id="plan",
        redis_conn_id=REDIS_CONN_ID,
        deferrable=True,
        poke_interval=2,
        timeout=60,
        processor=cancel_orders,
        target_conn_id=CONN_ID,
        outlets=[stream_asset("kt_verify_defer")],
    )
