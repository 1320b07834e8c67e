"""The DAG that ``tests/scheduler/test_real_scheduler.py`` triggers on a real Airflow deployment.

``plan`` fixes one round over ``KEYSET_SCHED_TABLE`` and splits it into ranges; ``traverse`` is
mapped over the ranges; ``barrier`` (deferrable) waits for the round in the real triggerer. The
barrier depends on ``plan`` only, so it is deferred while the ranges are still running (a barrier
that starts after a complete round closes it at once and never reaches the triggerer).

The processor ``record_and_sleep`` is the independent record the test checks coverage against:
for every row of every chunk delivered it inserts ``(seq, range_id, try_number, pid, ppid,
chunk_first)`` into ``KEYSET_SCHED_EFFECTS`` (no unique constraint: every delivery is a row),
commits, then sleeps ``KEYSET_SCHED_SLEEP_S`` so the ranges run long enough to be killed in the
middle. ``pid`` is the task process (the one the test SIGKILLs), ``ppid`` its supervisor.

Everything deployment-specific comes from environment variables that the test sets for every
Airflow process (connection ids, Redis key prefix and stream, table names, tuning).
"""

from __future__ import annotations

import datetime as dt
import os
import time

import sqlalchemy as sa
from airflow.sdk import DAG, get_current_context

from airflow_keyset_provider import BarrierSensor, Chunk, PlanRangesOperator, TraverseRangeOperator


def _env(name: str, default: str) -> str:
    return os.environ.get(f"KEYSET_SCHED_{name}", default)


SOURCE_CONN_ID = _env("SOURCE_CONN", "keyset_sched_db")
REDIS_CONN_ID = _env("REDIS_CONN", "keyset_sched_redis")
KEY_PREFIX = _env("KEY_PREFIX", "ks")
STREAM = _env("STREAM", "keyset_scheduler_kill")
TABLE = _env("TABLE", "sched_events")
EFFECTS_TABLE = _env("EFFECTS", "sched_effects")
MAX_RANGES = int(_env("MAX_RANGES", "2"))
CHUNK_SIZE = int(_env("CHUNK_SIZE", "15"))
SLEEP_S = float(_env("SLEEP_S", "0.05"))
RETRIES = int(_env("RETRIES", "2"))
RETRY_DELAY_S = float(_env("RETRY_DELAY_S", "3"))
BARRIER_TIMEOUT_S = float(_env("BARRIER_TIMEOUT_S", "180"))
RESUME_POLL_S = float(_env("RESUME_POLL_S", "5"))  # a paused task's trigger polls this often

_ENGINE: sa.Engine | None = None  # one per task process: each try runs in a process of its own


def _effects_engine() -> sa.Engine:
    global _ENGINE
    if _ENGINE is None:
        from airflow_keyset_provider.hooks.keyset import KeysetHook

        _ENGINE = sa.create_engine(KeysetHook(SOURCE_CONN_ID).source_url(), pool_size=1)
    return _ENGINE


def record_and_sleep(chunk: Chunk) -> None:
    """Record every delivered key (with this try and process), then take a while."""
    ti = get_current_context()["ti"]
    keys = chunk.keys
    rows = [
        {
            "seq": k,
            "range_id": chunk.range_id,
            "try_number": ti.try_number,
            "pid": os.getpid(),
            "ppid": os.getppid(),
            "chunk_first": keys[0],
        }
        for k in keys
    ]
    if rows:
        with _effects_engine().begin() as conn:
            conn.execute(
                sa.text(
                    f"INSERT INTO {EFFECTS_TABLE} (seq, range_id, try_number, pid, ppid, chunk_first) "
                    "VALUES (:seq, :range_id, :try_number, :pid, :ppid, :chunk_first)"
                ),
                rows,
            )
    time.sleep(SLEEP_S)


with DAG(
    dag_id="keyset_scheduler_kill",
    schedule=None,
    start_date=dt.datetime(2024, 1, 1, tzinfo=dt.UTC),
    catchup=False,
    max_active_runs=1,
    tags=["keyset", "test"],
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
    )
    traverse = TraverseRangeOperator.partial(
        task_id="traverse",
        processor=record_and_sleep,
        redis_conn_id=REDIS_CONN_ID,
        chunk_size=CHUNK_SIZE,
        lease_seconds=30,
        max_chunk_attempts=3,
        log_every_seconds=2,
        resume_poll_seconds=RESUME_POLL_S,
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
