"""Pull-mode DAGs that only the Airflow tests run (linked into the throwaway DAGs folder by
conftest.py): many ranges over few mapped tasks (``PlanRangesOperator(max_tasks=...)``), and a
pull task that spends its time budget and defers to continue in a fresh process."""

from __future__ import annotations

import datetime as dt
import time
from typing import Any

from airflow.sdk import DAG, Context
from keyset_examples_common import (
    EVENTS_TABLE,
    KEY_PREFIX,
    REDIS_CONN_ID,
    SOURCE_CONN_ID,
    redispatch,
)

from airflow_keyset_provider import (
    BarrierSensor,
    Chunk,
    ChunkResult,
    PlanRangesOperator,
    TraverseRangeOperator,
)

START = dt.datetime(2024, 1, 1, tzinfo=dt.UTC)

#: what each return from ``KeysetResumeTrigger`` waited for
RESUMED: list[str] = []


class PullRecordingResumes(TraverseRangeOperator):
    def execute_resume(self, context: Context, event: dict[str, Any] | None = None) -> Any:
        RESUMED.append((event or {}).get("wait_for", "?"))
        return super().execute_resume(context, event)


def slow_redispatch(chunk: Chunk) -> ChunkResult:
    time.sleep(0.05)
    return redispatch(chunk)


def _round(max_ranges: int, max_tasks: int, **traverse: Any) -> None:
    plan = PlanRangesOperator(
        task_id="plan",
        source_conn_id=SOURCE_CONN_ID,
        table=EVENTS_TABLE,
        key="seq",
        columns=["user_id", "kind", "payload"],
        redis_conn_id=REDIS_CONN_ID,
        key_prefix=KEY_PREFIX,
        max_ranges=max_ranges,
        max_tasks=max_tasks,
    )
    tasks = PullRecordingResumes.partial(
        task_id="traverse", redis_conn_id=REDIS_CONN_ID, retries=0, **traverse
    ).expand_kwargs(plan.output)
    barrier = BarrierSensor(
        task_id="barrier",
        plan_task_id="plan",
        redis_conn_id=REDIS_CONN_ID,
        poke_interval=0.5,
        timeout=60,
    )
    plan >> tasks >> barrier


# 64 ranges over 4 mapped tasks (dag.test runs them one after the other: the first pulls them all)
with DAG("kt_pull", schedule=None, start_date=START, catchup=False) as kt_pull:
    _round(64, 4, processor=redispatch, chunk_size=10)

# a pull task whose 0.5 s budget runs out again and again: it defers and resumes by lineage
with DAG("kt_pull_budget", schedule=None, start_date=START, catchup=False) as kt_pull_budget:
    _round(
        4,
        2,
        processor=slow_redispatch,
        chunk_size=20,
        max_task_seconds=0.5,
        resume_poll_seconds=0.2,
    )
