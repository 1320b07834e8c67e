"""Example 1: nightly redispatch of an IM event stream.

Every night one round traverses the events that arrived since the previous round (``seq`` is a
``bigserial``): the plan starts the round at the stream's watermark (the end of the last closed
round) and ends it at the largest committed ``seq``; each range becomes a mapped task that writes
its events to an outbox with ``INSERT ... ON CONFLICT DO NOTHING``; the barrier closes the round
once every range is complete, which moves the watermark for the next night.

Retry a failed range from the UI: it resumes from its Redis cursor. Clearing the plan task of a
run returns the same round. Connection ids and table names: see ``keyset_examples_common``.
"""

from __future__ import annotations

import datetime as dt

from airflow.sdk import DAG
from keyset_examples_common import (
    EVENTS_TABLE,
    KEY_PREFIX,
    REDIS_CONN_ID,
    SOURCE_CONN_ID,
    redispatch,
    task_defaults,
)

from airflow_keyset_provider import BarrierSensor, PlanRangesOperator, TraverseRangeOperator

cfg = task_defaults()

with DAG(
    dag_id="nightly_event_redispatch",
    schedule="@daily",
    start_date=dt.datetime(2024, 1, 1, tzinfo=dt.UTC),
    catchup=False,
    max_active_runs=1,  # rounds chain by watermark; one night at a time
    tags=["keyset", "example"],
    doc_md=__doc__,
) as dag:
    plan = PlanRangesOperator(
        task_id="plan",
        source_conn_id=SOURCE_CONN_ID,
        table=EVENTS_TABLE,
        key="seq",
        columns=["user_id", "kind", "payload"],
        redis_conn_id=REDIS_CONN_ID,
        key_prefix=KEY_PREFIX,
        max_ranges=cfg["max_ranges"],  # start_key/end_key None: from the watermark to max(seq)
    )
    traverse = TraverseRangeOperator.partial(
        task_id="traverse",
        processor=redispatch,  # or "keyset_examples_common:redispatch"
        redis_conn_id=REDIS_CONN_ID,
        chunk_size=cfg["chunk_size"],
        lease_seconds=60,
        max_chunk_attempts=5,
        max_item_attempts=3,
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
    plan >> traverse >> barrier
