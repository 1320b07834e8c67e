"""DAGs of the Airflow-native tests (``test_keyset_native.py``): a wide plan whose ``max_ranges``
comes from the environment (the test raises ``[core] max_map_length`` in a subprocess), and a
small plan -> traverse -> barrier run for lineage and extra links. Linked into the throwaway DAGs
folder by conftest.py."""

from __future__ import annotations

import datetime as dt
import os

from airflow.sdk import DAG
from keyset_examples_common import EVENTS_TABLE, KEY_PREFIX, REDIS_CONN_ID, SOURCE_CONN_ID

from airflow_keyset_provider import BarrierSensor, Chunk, PlanRangesOperator, TraverseRangeOperator
from airflow_keyset_provider.operators.preview import PreviewRoundOperator

START = dt.datetime(2024, 1, 1, tzinfo=dt.UTC)


def count_only(chunk: Chunk) -> None:
    """Read every row, write nothing."""


# max_ranges from the environment: 8 when the DAG folder is parsed with Airflow's default
# max_map_length (1024); the test sets 1500 together with AIRFLOW__CORE__MAX_MAP_LENGTH=2048.
with DAG("kt_wide_plan", schedule=None, start_date=START, catchup=False) as kt_wide_plan:
    PlanRangesOperator(
        task_id="plan",
        source_conn_id=SOURCE_CONN_ID,
        table=EVENTS_TABLE,
        key="seq",
        redis_conn_id=REDIS_CONN_ID,
        key_prefix=KEY_PREFIX,
        max_ranges=int(os.environ.get("KT_WIDE_MAX_RANGES", "8")),
    )

with DAG("kt_native", schedule=None, start_date=START, catchup=False) as kt_native:
    plan = PlanRangesOperator(
        task_id="plan",
        source_conn_id=SOURCE_CONN_ID,
        table=EVENTS_TABLE,
        key="seq",
        redis_conn_id=REDIS_CONN_ID,
        key_prefix=KEY_PREFIX,
        max_ranges=2,
    )
    traverse = TraverseRangeOperator.partial(
        task_id="traverse",
        processor=count_only,
        redis_conn_id=REDIS_CONN_ID,
        chunk_size=100,
    ).expand_kwargs(plan.output)
    barrier = BarrierSensor(
        task_id="barrier",
        plan_task_id="plan",
        redis_conn_id=REDIS_CONN_ID,
        poke_interval=0.5,
        timeout=60,
    )
    plan >> traverse >> barrier


# The UI page's preview panel (tests/ui/test_ui_preview.py): a preview, then the plan it previewed.
with DAG("kt_preview", schedule=None, start_date=START, catchup=False) as kt_preview:
    _round = {
        "source_conn_id": SOURCE_CONN_ID,
        "table": EVENTS_TABLE,
        "key": "seq",
        "stream": "kt_preview",
        "redis_conn_id": REDIS_CONN_ID,
        "key_prefix": KEY_PREFIX,
        "max_ranges": 2,
    }
    (
        PreviewRoundOperator(
            task_id="preview",
            processor=count_only,
            target_conn_id=SOURCE_CONN_ID,
            chunk_size=20,
            **_round,
        )
        >> PlanRangesOperator(task_id="plan", **_round)
    )
