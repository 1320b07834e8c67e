"""The DAG that ``tests/celery/test_celery_workers.py`` triggers on a CeleryExecutor deployment.

``plan`` fixes one round over ``KEYSET_CELERY_TABLE`` and splits it into ranges; ``traverse`` is
mapped over them (``retries`` in ``.partial()``: a try lost with its worker is retried, on any
worker, and resumes from the range's cursor). With ``KEYSET_CELERY_MAX_TASKS`` set, pull mode:
the plan returns that many dicts and each ``traverse`` task works through the round's ranges
(claiming, rescuing, splitting stragglers) until none is left. ``barrier`` (deferrable) waits in
the triggerer and closes the round. The processor is given by reference, ``"keyset_celery_effects:record_and_sleep"``
(a module of this DAG bundle), so every worker resolves it from the bundle it runs the task from.

Everything deployment-specific comes from environment variables the test sets for every Airflow
process (connection ids, Redis key prefix and stream, table, tuning).
"""

from __future__ import annotations

import datetime as dt
import os

from airflow.sdk import DAG

from airflow_keyset_provider import BarrierSensor, PlanRangesOperator, TraverseRangeOperator


def _env(name: str, default: str) -> str:
    return os.environ.get(f"KEYSET_CELERY_{name}", default)


SOURCE_CONN_ID = _env("SOURCE_CONN", "keyset_celery_db")
REDIS_CONN_ID = _env("REDIS_CONN", "keyset_celery_redis")
KEY_PREFIX = _env("KEY_PREFIX", "ks")
STREAM = _env("STREAM", "keyset_celery_kill")
TABLE = _env("TABLE", "celery_events")
MAX_RANGES = int(_env("MAX_RANGES", "2"))
MAX_TASKS = int(_env("MAX_TASKS", "0")) or None  # None: one mapped task per range
CHUNK_SIZE = int(_env("CHUNK_SIZE", "20"))
RETRIES = int(_env("RETRIES", "2"))
RETRY_DELAY_S = float(_env("RETRY_DELAY_S", "3"))
BARRIER_TIMEOUT_S = float(_env("BARRIER_TIMEOUT_S", "180"))

with DAG(
    dag_id="keyset_celery_kill",
    schedule=None,
    start_date=dt.datetime(2024, 1, 1, tzinfo=dt.UTC),
    catchup=False,
    max_active_runs=1,
    tags=["keyset", "test", "celery"],
    doc_md=__doc__,
) as dag:
    plan = PlanRangesOperator(
        task_id="plan",
        source_conn_id=SOURCE_CONN_ID,
        table=TABLE,
        key="seq",
        redis_conn_id=REDIS_CONN_ID,
        stream=STREAM,
        key_prefix=KEY_PREFIX,
        max_ranges=MAX_RANGES,
        max_tasks=MAX_TASKS,
    )
    traverse = TraverseRangeOperator.partial(
        task_id="traverse",
        processor="keyset_celery_effects:record_and_sleep",
        redis_conn_id=REDIS_CONN_ID,
        chunk_size=CHUNK_SIZE,
        lease_seconds=30,
        max_chunk_attempts=3,
        log_every_seconds=2,
        retries=RETRIES,
        retry_delay=dt.timedelta(seconds=RETRY_DELAY_S),
    ).expand_kwargs(plan.output)
    barrier = BarrierSensor(
        task_id="barrier",
        plan_task_id="plan",
        redis_conn_id=REDIS_CONN_ID,
        deferrable=True,
        poke_interval=1,
        timeout=BARRIER_TIMEOUT_S,
    )
    plan >> [traverse, barrier]
