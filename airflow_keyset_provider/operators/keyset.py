"""``PlanRangesOperator`` and ``TraverseRangeOperator``: thin adapters over ``KeysetTraversal``.

A round is planned once per DAG run and plan task, then every range becomes one mapped task::

    plan = PlanRangesOperator(
        task_id="plan", source_conn_id="events_db", table="im_events", key="seq"
    )
    traverse = TraverseRangeOperator.partial(
        task_id="traverse", processor=redispatch, retries=3,
    ).expand_kwargs(plan.output)
    barrier = BarrierSensor(task_id="barrier", plan_task_id="plan")
    plan >> traverse >> barrier

Guarantees (on top of the engine's, see ``airflow_keyset_provider.core.traversal``):

- Retrying or clearing the plan task returns the same round with the same ranges: the round is
  keyed by ``<dag_id>/<run_id>/<task_id>``.
- Every try of a mapped range resumes from the range's committed cursor in Redis. The owner
  lineage ``<dag_id>/<run_id>/<task_id>/<map_index>`` lets a new try take the range over at once
  and fences the previous try, so at most one chunk is delivered again.
- A try succeeds only if its range is complete; a stopped or failed traversal fails the try, so
  Airflow's retry continues it. Configuration errors (bad key, missing or wrong connection, bad
  argument) and a lost round fail the task at once, without retries, with the engine's message.
- The Airflow pool slot is taken before the task runs, so ``pool=`` bounds how many ranges are
  claimed at the same time.
- Airflow 3.3's task state store of each traverse task instance holds the range's committed
  cursor and counters under ``keyset_range`` (written at most every ``state_store_seconds`` while
  the range runs, and once when the try ends), so the UI and the REST API show them. It is a
  mirror: the cursor is read from Redis, never from there.

The operators live in ``operators.plan`` and ``operators.traverse`` (one module per operator); this
module re-exports them so ``airflow_keyset_provider.operators.keyset`` keeps working.
"""

from __future__ import annotations

from airflow_keyset_provider.common import (
    DEFAULT_MAP_INDEX_TEMPLATE,
    RANGE_LABEL_CONTEXT_KEY,
    ROUND_ID_XCOM_KEY,
    ROUND_XCOM_KEY,
    airflow_errors,
    key_label,
)
from airflow_keyset_provider.operators.plan import (
    AIRFLOW_DEFAULT_MAX_MAP_LENGTH,
    PlanRangesOperator,
)
from airflow_keyset_provider.operators.traverse import RANGE_STATE_KEY, TraverseRangeOperator

__all__ = [
    "AIRFLOW_DEFAULT_MAX_MAP_LENGTH",
    "DEFAULT_MAP_INDEX_TEMPLATE",
    "RANGE_LABEL_CONTEXT_KEY",
    "RANGE_STATE_KEY",
    "ROUND_ID_XCOM_KEY",
    "ROUND_XCOM_KEY",
    "PlanRangesOperator",
    "TraverseRangeOperator",
    "airflow_errors",
    "key_label",
]
