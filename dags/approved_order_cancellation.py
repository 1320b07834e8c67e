"""Example 6: a destructive write-back done safely: preview, a person's approval, then the round.

``preview`` shows what the round would do before it writes anything: its bounds, the ranges with
the database's row estimates, the chunk query's plan, a sample chunk and the processor's verdict
on it (applied / not applied / failed, in a target transaction that is rolled back) and the ETA.
``approve`` is Airflow's own ``ApprovalOperator``: it shows the preview (its Markdown rendering)
and waits for Approve or Reject, from the UI or the REST API. Approve: ``plan`` fixes the round,
``traverse`` cancels every stale PENDING order, ``barrier`` verifies that no order of the round
is still PENDING (else it fails naming the keys) and closes the round. Reject: everything
after ``approve`` is skipped; nothing was written anywhere, the stream is as it was.
"""

from __future__ import annotations

import datetime as dt

from airflow.providers.standard.operators.hitl import ApprovalOperator
from airflow.sdk import DAG
from keyset_examples_common import (
    KEY_PREFIX,
    ORDERS_TABLE,
    REDIS_CONN_ID,
    SOURCE_CONN_ID,
    cancel_pending,
    task_defaults,
)

from airflow_keyset_provider import BarrierSensor, PlanRangesOperator, TraverseRangeOperator
from airflow_keyset_provider.operators.preview import PreviewRoundOperator

cfg = task_defaults()
ROUND = {  # what the preview and the plan both read
    "source_conn_id": SOURCE_CONN_ID,
    "table": ORDERS_TABLE,
    "key": ["created_at", "id"],
    "where": "status = 'PENDING'",
    "redis_conn_id": REDIS_CONN_ID,
    "key_prefix": KEY_PREFIX,
    "max_ranges": cfg["max_ranges"],
}

with DAG(
    dag_id="approved_order_cancellation",
    schedule=None,  # triggered by a person, who then approves or rejects what the preview shows
    start_date=dt.datetime(2026, 1, 1, tzinfo=dt.UTC),
    catchup=False,
    tags=["keyset", "example"],
    doc_md=__doc__,
) as dag:
    preview = PreviewRoundOperator(
        task_id="preview",
        plan_task_id="plan",
        processor=cancel_pending,
        target_conn_id=SOURCE_CONN_ID,  # the processor's writes on the sample are rolled back
        chunk_size=cfg["chunk_size"],
        **ROUND,
    )
    approve = ApprovalOperator(
        task_id="approve",
        subject="Cancel ~{{ ti.xcom_pull(task_ids='preview')['estimated_rows'] }} stale orders?",
        body="{{ ti.xcom_pull(task_ids='preview', key='keyset_preview_markdown') }}",
        ignore_downstream_trigger_rules=True,  # Reject skips the plan, the round and its barrier
        response_timeout=dt.timedelta(days=1),
    )
    plan = PlanRangesOperator(
        task_id="plan",
        verify="status = 'PENDING'",  # before it closes: no order of the round still pending
        **ROUND,
    )
    traverse = TraverseRangeOperator.partial(
        task_id="traverse",
        processor=cancel_pending,
        target_conn_id=SOURCE_CONN_ID,
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
    preview >> approve >> plan >> traverse >> barrier
