"""Example 3: a sharded roll-up whose summary never runs on half the shards.

Sales are keyed by ``(region, id)``, so the ranges of a round (the shards) follow region
boundaries as far as row counts allow. Each shard records its sales for the round; the summary
runs after ``BarrierSensor``, which succeeds only when every shard's range is complete and the
shards cover the round with no gap (it reads the cursors in Redis, not task states: a shard marked
"success" by hand does not open it). The summary then checks that it sees exactly the rows the
closed round traversed and writes per-region totals.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from airflow.sdk import DAG, task
from keyset_examples_common import (
    KEY_PREFIX,
    REDIS_CONN_ID,
    SALES_TABLE,
    SOURCE_CONN_ID,
    collect_shard,
    summarize_round,
    task_defaults,
)

from airflow_keyset_provider import BarrierSensor, PlanRangesOperator, TraverseRangeOperator

cfg = task_defaults()

with DAG(
    dag_id="sharded_rollup",
    schedule="@daily",
    start_date=dt.datetime(2024, 1, 1, tzinfo=dt.UTC),
    catchup=False,
    max_active_runs=1,
    tags=["keyset", "example"],
    doc_md=__doc__,
) as dag:
    plan = PlanRangesOperator(
        task_id="plan",
        source_conn_id=SOURCE_CONN_ID,
        table=SALES_TABLE,
        key=["region", "id"],
        columns=["amount_cents"],
        redis_conn_id=REDIS_CONN_ID,
        key_prefix=KEY_PREFIX,
        max_ranges=cfg["max_ranges"],
    )
    shards = TraverseRangeOperator.partial(
        task_id="shard",
        processor=collect_shard,
        redis_conn_id=REDIS_CONN_ID,
        chunk_size=cfg["chunk_size"],
        retries=cfg["retries"],
        retry_delay=cfg["retry_delay"],
    ).expand_kwargs(plan.output)
    barrier = BarrierSensor(
        task_id="barrier",
        plan_task_id="plan",
        redis_conn_id=REDIS_CONN_ID,
        poke_interval=cfg["poke_interval"],
        timeout=cfg["barrier_timeout"],
    )

    @task
    def summary(totals: dict[str, Any]) -> dict[str, Any]:
        """Per-region totals of the closed round (refuses a partial round)."""
        return summarize_round(totals)

    plan >> shards >> barrier
    summary(barrier.output)
