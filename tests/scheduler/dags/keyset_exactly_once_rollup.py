"""Example: copy rows into a roll-up table with no unique key, exactly once (``exactly_once``).

``traverse`` writes one roll-up row per source row through ``chunk.connection`` (the engine's
transaction on ``target_conn_id``) into ``KEYSET_XO_ROLLUP``, a table with no unique key, so a
write done twice would stay. With ``exactly_once=True`` those writes commit together with the
chunk's key interval in the round's ledger (``keyset_ledger`` on the target, created on first
use), fenced by the owner's generation, before the Redis cursor moves; a try that dies at any point leaves either the
whole chunk (and the ledger says so: the next try moves the cursor forward to it) or nothing.

The first try of range 0 SIGKILLs itself in the middle of its ``KEYSET_XO_KILL_AT``-th chunk
(after its insert, before anything committed); Airflow's retry resumes the range. The run still
writes every row exactly once. ``tests/scheduler/test_exactly_once_scheduler.py`` runs it under
a real scheduler; everything deployment-specific comes from environment variables.
"""

from __future__ import annotations

import datetime as dt
import os
import signal

import sqlalchemy as sa
from airflow.sdk import DAG, get_current_context

from airflow_keyset_provider import BarrierSensor, Chunk, PlanRangesOperator, TraverseRangeOperator

SOURCE_CONN_ID = os.environ.get("KEYSET_XO_SOURCE_CONN", "keyset_xo_db")
REDIS_CONN_ID = os.environ.get("KEYSET_XO_REDIS_CONN", "keyset_xo_redis")
KEY_PREFIX = os.environ.get("KEYSET_XO_KEY_PREFIX", "ks")
ROLLUP = os.environ.get("KEYSET_XO_ROLLUP", "xo_rollup")
KILL_AT = int(os.environ.get("KEYSET_XO_KILL_AT", "0"))  # 0: no kill
_chunks = 0


def copy_to_rollup(chunk: Chunk) -> None:
    """One roll-up row per sale, in the engine's transaction (never committed here)."""
    global _chunks
    chunk.connection.execute(
        sa.text(f"INSERT INTO {ROLLUP} (sale_id, region, amount_cents) VALUES (:i, :r, :a)"),
        [
            {"i": k, "r": r["region"], "a": r["amount_cents"]}
            for k, r in zip(chunk.keys, chunk.rows, strict=True)
        ],
    )
    _chunks += 1
    ti = get_current_context()["ti"]
    if KILL_AT and chunk.range_id == 0 and ti.try_number == 1 and _chunks == KILL_AT:
        os.kill(os.getpid(), signal.SIGKILL)  # the try dies with its transaction uncommitted


with DAG(
    dag_id="keyset_exactly_once_rollup",
    schedule=None,
    start_date=dt.datetime(2024, 1, 1, tzinfo=dt.UTC),
    catchup=False,
    max_active_runs=1,
    tags=["keyset", "example"],
    doc_md=__doc__,
) as dag:
    plan = PlanRangesOperator(
        task_id="plan",
        source_conn_id=SOURCE_CONN_ID,
        table="xo_sales",
        key="id",
        redis_conn_id=REDIS_CONN_ID,
        stream="xo_sales",
        key_prefix=KEY_PREFIX,
        columns=["region", "amount_cents"],
        max_ranges=2,
    )
    traverse = TraverseRangeOperator.partial(
        task_id="traverse",
        processor=copy_to_rollup,
        redis_conn_id=REDIS_CONN_ID,
        target_conn_id=SOURCE_CONN_ID,
        exactly_once=True,
        chunk_size=100,
        lease_seconds=30,
        retries=2,
        retry_delay=dt.timedelta(seconds=2),
    ).expand_kwargs(plan.output)
    barrier = BarrierSensor(
        task_id="barrier", plan_task_id="plan", redis_conn_id=REDIS_CONN_ID, poke_interval=1
    )
    plan >> traverse >> barrier
