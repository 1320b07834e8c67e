"""Example 2: cancel orders that stayed PENDING past their timeout.

The key is ``(created_at, id)``. Each run traverses the orders created in its data interval,
shifted back by the timeout: ``[data_interval_start - timeout, data_interval_end - timeout)``, as
the round ``((window_start, 0), (window_end, 0)]`` (ids are positive, so ``(t, 0)`` sorts before
every order created at ``t``). Consecutive intervals therefore tile time with no gap and no
overlap, and a backfill of past dates (``airflow backfill create --dag-id order_timeout_cancel
--from-date ... --to-date ...``) traverses exactly those dates.

The processor does one guarded bulk update per chunk, ``status PENDING -> CANCELLED``; orders
paid meanwhile (they won the race) are left alone and counted as *skipped*.

A manual run has no data interval: pass ``window_start`` and ``window_end`` (ISO 8601) as params,
or the plan fails and says so.
"""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

from airflow.sdk import DAG, CronDataIntervalTimetable, Param
from airflow.sdk.exceptions import AirflowFailException
from keyset_examples_common import (
    KEY_PREFIX,
    ORDERS_TABLE,
    REDIS_CONN_ID,
    SOURCE_CONN_ID,
    cancel_expired,
    task_defaults,
)

from airflow_keyset_provider import BarrierSensor, PlanRangesOperator, TraverseRangeOperator

cfg = task_defaults()


def order_window(edge: str, interval_edge: Any, params: dict[str, Any]) -> str:
    """The round bound for one edge of the window, as JSON ``["<ISO timestamp>", 0]``."""
    given = params.get(f"window_{edge}")
    if given:
        moment = dt.datetime.fromisoformat(str(given))
    elif isinstance(interval_edge, dt.datetime):
        moment = interval_edge - dt.timedelta(minutes=float(params["timeout_minutes"]))
    else:
        raise AirflowFailException(
            "order_timeout_cancel needs a data interval: run it on its schedule or as a backfill "
            "(airflow backfill create --dag-id order_timeout_cancel --from-date ... --to-date ...), "
            "or trigger it with params window_start and window_end (ISO 8601)."
        )
    if moment.tzinfo is None:
        raise AirflowFailException(
            f"window_{edge}={given!r} needs a UTC offset, e.g. 2024-01-01T00:00:00+00:00"
        )
    return json.dumps([moment.isoformat(), 0])


with DAG(
    dag_id="order_timeout_cancel",
    # a timetable with data intervals (Airflow 3's plain "@hourly" gives each run an empty one)
    schedule=CronDataIntervalTimetable("@hourly", timezone="UTC"),
    start_date=dt.datetime(2024, 1, 1, tzinfo=dt.UTC),
    catchup=False,
    tags=["keyset", "example"],
    doc_md=__doc__,
    params={
        "timeout_minutes": Param(30, type="number", minimum=0),
        "window_start": Param(None, type=["null", "string"]),
        "window_end": Param(None, type=["null", "string"]),
    },
    user_defined_macros={"order_window": order_window},
) as dag:
    plan = PlanRangesOperator(
        task_id="plan",
        source_conn_id=SOURCE_CONN_ID,
        table=ORDERS_TABLE,
        key=["created_at", "id"],
        redis_conn_id=REDIS_CONN_ID,
        key_prefix=KEY_PREFIX,
        # explicit bounds: each run has its own round (no watermark chaining)
        start_key="{{ order_window('start', data_interval_start, params) }}",
        end_key="{{ order_window('end', data_interval_end, params) }}",
        max_ranges=cfg["max_ranges"],
    )
    traverse = TraverseRangeOperator.partial(
        task_id="traverse",
        processor=cancel_expired,
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
    plan >> traverse >> barrier
