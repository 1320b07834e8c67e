"""Two daily DAGs over the same source for ``tests/scheduler/test_backfill_scheduler.py``, run
with ``airflow backfill create`` (issue 30 item 5).

``bf_events`` has one row per 30 minutes, keyed by ``ts`` (epoch seconds, unique). Each DAG
copies the rows it traverses into ``bf_delivered`` (no unique key: a row delivered twice stays
twice) with ``exactly_once`` on the same database.

- ``keyset_backfill_chained``: a chained plan (no ``start_key``), ``max_active_runs=1``: the
  way a nightly stream is written. A backfill run of it must fail at plan, naming the fix.
- ``keyset_backfill_bounded``: the documented way (docs/howto-backfills.md), bounds from the
  data interval: ``start_key`` / ``end_key`` are the interval's edges in epoch seconds.

Both end 5 days after ``KEYSET_BF_START`` (``end_date``), before the test's today, so the
scheduler creates no run of its own: every run in the test is a backfill run. Everything deployment-specific comes from environment
variables.
"""

from __future__ import annotations

import datetime as dt
import os

import sqlalchemy as sa
from airflow.sdk import DAG, CronDataIntervalTimetable

from airflow_keyset_provider import BarrierSensor, Chunk, PlanRangesOperator, TraverseRangeOperator

SOURCE_CONN_ID = os.environ.get("KEYSET_BF_SOURCE_CONN", "keyset_bf_db")
REDIS_CONN_ID = os.environ.get("KEYSET_BF_REDIS_CONN", "keyset_bf_redis")
KEY_PREFIX = os.environ.get("KEYSET_BF_KEY_PREFIX", "ks")
# the first day the DAGs run (ISO date; the test gives one 10 days before today): fixed dates would
# turn into future dates, which a backfill refuses, on a machine whose clock is behind
START = dt.datetime.fromisoformat(os.environ.get("KEYSET_BF_START", "2026-11-01")).replace(
    tzinfo=dt.UTC
)
END = START + dt.timedelta(days=5)


def deliver(chunk: Chunk) -> None:
    """One ``bf_delivered`` row per source row, in the engine's transaction."""
    chunk.connection.execute(
        sa.text("INSERT INTO bf_delivered (ts, round_id) VALUES (:ts, :r)"),
        [{"ts": k, "r": chunk.round_id} for k in chunk.keys],
    )


def daily_dag(dag_id: str, stream: str, **bounds: str) -> DAG:
    with DAG(
        dag_id=dag_id,
        schedule=CronDataIntervalTimetable("@daily", timezone="UTC"),
        start_date=START,
        end_date=END,
        catchup=False,
        max_active_runs=1,
        tags=["keyset", "test"],
        doc_md=__doc__,
    ) as dag:
        plan = PlanRangesOperator(
            task_id="plan",
            source_conn_id=SOURCE_CONN_ID,
            table="bf_events",
            key="ts",
            redis_conn_id=REDIS_CONN_ID,
            stream=stream,
            key_prefix=KEY_PREFIX,
            max_ranges=2,
            retries=2,  # a refusal is AirflowFailException: never retried
            retry_delay=dt.timedelta(seconds=1),
            **bounds,
        )
        traverse = TraverseRangeOperator.partial(
            task_id="traverse",
            processor=deliver,
            redis_conn_id=REDIS_CONN_ID,
            target_conn_id=SOURCE_CONN_ID,
            exactly_once=True,
            chunk_size=10,
            retries=2,
            retry_delay=dt.timedelta(seconds=2),
        ).expand_kwargs(plan.output)
        barrier = BarrierSensor(
            task_id="barrier", plan_task_id="plan", redis_conn_id=REDIS_CONN_ID, poke_interval=1
        )
        plan >> traverse >> barrier
    return dag


chained = daily_dag("keyset_backfill_chained", "bf_chained")
bounded = daily_dag(
    "keyset_backfill_bounded",
    "bf_bounded",
    start_key="{{ data_interval_start.timestamp() | int }}",
    end_key="{{ data_interval_end.timestamp() | int }}",
)
