"""The deferrable path of the barrier's asset event, on a real deployment (with
``dags/downstream_on_round.py``, linked into the same DAGs folder by the test).

``keyset_assets_deferred`` plans one range and runs its traverse task and a deferrable barrier at
the same time (``plan >> [traverse, barrier]``, the processor sleeps ``KEYSET_ASSETS_SLEEP_S`` per
chunk): the barrier defers to the real triggerer while the range runs, and closes the round in
``execute_complete``, on a worker, in a new task process. ``keyset_assets_deferred_report`` is
scheduled on the stream's asset and returns the ``extra`` of each event that triggered it.
"""

from __future__ import annotations

import datetime as dt
import os
import time
from typing import Any

from airflow.sdk import DAG, task

from airflow_keyset_provider import (
    BarrierSensor,
    Chunk,
    PlanRangesOperator,
    TraverseRangeOperator,
    stream_asset,
)


def _env(name: str, default: str) -> str:
    return os.environ.get(f"KEYSET_ASSETS_{name}", default)


STREAM = _env("STREAM", "keyset_assets_deferred")
ROUNDS = stream_asset(STREAM)
SLEEP_S = float(_env("SLEEP_S", "0.2"))
START = dt.datetime(2024, 1, 1, tzinfo=dt.UTC)


def slow(chunk: Chunk) -> None:
    time.sleep(SLEEP_S)


with DAG("keyset_assets_deferred", schedule=None, start_date=START, catchup=False):
    plan = PlanRangesOperator(
        task_id="plan",
        source_conn_id=_env("SOURCE_CONN", "keyset_examples_db"),
        table=_env("TABLE", "im_events"),
        key="seq",
        stream=STREAM,
        redis_conn_id=_env("REDIS_CONN", "redis_default"),
        key_prefix=_env("KEY_PREFIX", "ks"),
        max_ranges=1,
    )
    traverse = TraverseRangeOperator.partial(
        task_id="traverse",
        processor=slow,
        redis_conn_id=_env("REDIS_CONN", "redis_default"),
        chunk_size=int(_env("CHUNK_SIZE", "50")),
        state_store_seconds=1,
    ).expand_kwargs(plan.output)
    barrier = BarrierSensor(
        task_id="barrier",
        plan_task_id="plan",
        redis_conn_id=_env("REDIS_CONN", "redis_default"),
        outlets=[ROUNDS],
        deferrable=True,
        poke_interval=1,
        timeout=120,
    )
    plan >> [traverse, barrier]

with DAG("keyset_assets_deferred_report", schedule=[ROUNDS], start_date=START, catchup=False):

    @task
    def rounds(triggering_asset_events: Any = None) -> list[dict[str, Any]]:
        return [dict(e.extra) for e in triggering_asset_events[ROUNDS]]

    rounds()
