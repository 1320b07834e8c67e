"""A DAG that only ``test_keyset_timeout.py`` runs (linked into the throwaway DAGs folder by
conftest.py): one range traversed by tries that each end by ``execution_timeout``."""

from __future__ import annotations

import datetime as dt
import time
from collections import Counter

from airflow.sdk import DAG, Context
from keyset_examples_common import EVENTS_TABLE, KEY_PREFIX, REDIS_CONN_ID, SOURCE_CONN_ID

from airflow_keyset_provider import Chunk, PlanRangesOperator, TraverseRangeOperator

START = dt.datetime(2024, 1, 1, tzinfo=dt.UTC)
#: Seconds each processor call takes (a tenth of the timeout margin of one second).
CHUNK_SECONDS = 0.1
TIMEOUT = dt.timedelta(seconds=3)

DELIVERED: Counter[int] = Counter()  # key -> times handed to the processor
RETRIES: list[str] = []  # why each try that Airflow retried ended


def reset() -> None:
    DELIVERED.clear()
    RETRIES.clear()


def record_retry(context: Context) -> None:
    exc = context.get("exception")
    RETRIES.append(f"{type(exc).__name__}: {exc}")


def slow_counting(chunk: Chunk) -> None:
    """Count each delivery of each key, then take a moment (where Airflow's alarm lands)."""
    DELIVERED.update(chunk.keys)
    time.sleep(CHUNK_SECONDS)


# One range of 300 keys in chunks of 10 (about 3 s of processing) under an execution_timeout of
# 3 s: it takes a few tries, each ended by the timeout; retries resume from the cursor.
with DAG("kt_timeout", schedule=None, start_date=START, catchup=False) as kt_timeout:
    plan = PlanRangesOperator(
        task_id="plan",
        source_conn_id=SOURCE_CONN_ID,
        table=EVENTS_TABLE,
        key="seq",
        redis_conn_id=REDIS_CONN_ID,
        key_prefix=KEY_PREFIX,
        max_ranges=1,
    )
    traverse = TraverseRangeOperator.partial(
        task_id="traverse",
        processor=slow_counting,
        redis_conn_id=REDIS_CONN_ID,
        chunk_size=10,
        prefetch=False,
        execution_timeout=TIMEOUT,
        retries=40,  # each try commits a chunk at least: 30 chunks need 30 tries at most
        retry_delay=dt.timedelta(0),
        on_retry_callback=record_retry,
    ).expand_kwargs(plan.output)
    plan >> traverse
