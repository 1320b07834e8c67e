"""Example 4: a downstream DAG that runs once a round is closed, and knows which round.

``events_to_outbox`` copies new IM events into an outbox, one chained round per run (as in
example 1). Its barrier declares the stream's asset as an outlet, ``stream_asset(STREAM)``
(``keyset://<stream>``): when the barrier closes a round, Airflow records one asset event whose
``extra`` carries the round (``round_id``, ``start_key``, ``end_key``, ``done``, ``skipped``,
``dead``), and the barrier mirrors the stream's watermark into the asset's state store. The event
comes from the single barrier task, never from the mapped traverse tasks.

``outbox_round_report`` is scheduled on that asset. Airflow may fold several events into one run
(rounds that closed while it was not running), so it handles every triggering event, once per
``round_id`` (a cleared barrier emits the same round again). For each round it checks that the
outbox holds a row for every key the round reached (``done + skipped``, no dead letters here).

Re-running one range (or any interval) from its start: trigger ``events_to_outbox`` with the
params ``start_key`` and ``end_key`` set to the range's bounds (the traverse task's map index label
and its ``keyset_range`` task state show them; for the first range, whose lower bound is open, give
a start below every key, e.g. ``0``). That plans a new round with explicit bounds: every key of
the interval is delivered again, the watermark is not moved back, and the report runs for it too.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

import sqlalchemy as sa
from airflow.sdk import DAG, task
from keyset_examples_common import (
    EVENTS_TABLE,
    KEY_PREFIX,
    OUTBOX_TABLE,
    REDIS_CONN_ID,
    SOURCE_CONN_ID,
    bool_setting,
    redispatch,
    setting,
    target_engine,
    task_defaults,
)

from airflow_keyset_provider import (
    BarrierSensor,
    PlanRangesOperator,
    TraverseRangeOperator,
    stream_asset,
)

cfg = task_defaults()
STREAM = setting("outbox_stream", "events_to_outbox")
ROUNDS = stream_asset(STREAM)  # the same Asset on both sides: keyset://<stream>
SCHEDULE = setting("outbox_schedule", "@daily") or None  # "": manual runs only (the tests)

with DAG(
    dag_id="events_to_outbox",
    schedule=SCHEDULE,
    start_date=dt.datetime(2024, 1, 1, tzinfo=dt.UTC),
    catchup=False,
    max_active_runs=1,
    params={"start_key": None, "end_key": None},  # set both to re-run an interval
    tags=["keyset", "example"],
    doc_md=__doc__,
) as producer:
    plan = PlanRangesOperator(
        task_id="plan",
        source_conn_id=SOURCE_CONN_ID,
        table=EVENTS_TABLE,
        key="seq",
        columns=["user_id", "kind", "payload"],
        stream=STREAM,
        redis_conn_id=REDIS_CONN_ID,
        key_prefix=KEY_PREFIX,
        max_ranges=cfg["max_ranges"],
        start_key="{{ params.start_key }}",  # None: the stream's watermark (a chained round)
        end_key="{{ params.end_key }}",  # None: max(seq), once every smaller seq has committed
    )
    traverse = TraverseRangeOperator.partial(
        task_id="traverse",
        processor=redispatch,
        redis_conn_id=REDIS_CONN_ID,
        chunk_size=cfg["chunk_size"],
        retries=cfg["retries"],
        retry_delay=cfg["retry_delay"],
    ).expand_kwargs(plan.output)
    barrier = BarrierSensor(
        task_id="barrier",
        plan_task_id="plan",
        redis_conn_id=REDIS_CONN_ID,
        outlets=[ROUNDS],  # one asset event per closed round, extra = the round
        deferrable=bool_setting("deferrable", False),
        poke_interval=cfg["poke_interval"],
        timeout=cfg["barrier_timeout"],
    )
    plan >> traverse >> barrier


with DAG(
    dag_id="outbox_round_report",
    schedule=[ROUNDS],  # runs after each closed round of the stream
    start_date=dt.datetime(2024, 1, 1, tzinfo=dt.UTC),
    catchup=False,
    tags=["keyset", "example"],
    doc_md=__doc__,
) as consumer:

    @task(inlets=[ROUNDS])
    def report(
        triggering_asset_events: Any = None, asset_state_store: Any = None
    ) -> dict[str, Any]:
        """Each closed round that triggered this run, checked against the outbox."""
        rounds: dict[str, dict[str, Any]] = {}
        for event in (triggering_asset_events or {}).get(ROUNDS, []):
            rounds.setdefault(event.extra["round_id"], dict(event.extra))  # once per round
        outbox = sa.table(OUTBOX_TABLE, sa.column("event_seq"))
        with target_engine().connect() as conn:
            for rnd in rounds.values():
                start, end = rnd["start_key"], rnd["end_key"]
                query = (
                    sa.select(sa.func.count()).select_from(outbox).where(outbox.c.event_seq <= end)
                )
                if start is not None:  # None: the first round starts below every key
                    query = query.where(outbox.c.event_seq > start)
                rnd["outbox_rows"] = conn.execute(query).scalar_one()
                if rnd["outbox_rows"] != rnd["done"] + rnd["skipped"] + rnd["dead"]:
                    raise ValueError(
                        f"round {rnd['round_id']}: the outbox disagrees with it: {rnd}"
                    )
        watermark = asset_state_store[ROUNDS].get("watermark") if asset_state_store else None
        return {"rounds": list(rounds.values()), "watermark": watermark}

    report()
