"""The three example DAGs, end to end under ``dag.test()`` (real PostgreSQL, real Redis).

Each test builds its tables in a fresh schema, runs the DAG, and checks exact counters: every
key of the round processed, ``done + skipped + dead`` equal to the number of keys, the stream's
watermark at the round's end.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest
import redis
import sqlalchemy as sa
from airflow.models.xcom import XComModel
from airflow.utils.session import create_session
from airflow.utils.state import DagRunState, TaskInstanceState
from keyset_examples_common import create_example_tables, example_metadata

from airflow_keyset_provider.core import StreamControl
from airflow_keyset_provider.core.store.cursor_store import CursorStore

pytestmark = pytest.mark.airflow


def xcom(dr: Any, task_id: str, key: str = "return_value", map_index: int = -1) -> Any:
    with create_session() as session:
        row = session.scalars(
            XComModel.get_many(
                run_id=dr.run_id,
                dag_ids=dr.dag_id,
                task_ids=task_id,
                key=key,
                map_indexes=map_index,
            )
        ).first()
        return None if row is None else XComModel.deserialize_value(row)


def states(dr: Any) -> dict[str, str]:
    with create_session() as session:
        dr = session.merge(dr)
        return {
            (ti.task_id if ti.map_index < 0 else f"{ti.task_id}[{ti.map_index}]"): ti.state
            for ti in dr.get_task_instances(session=session)
        }


def control(env: dict[str, Any], stream: str) -> StreamControl:
    return StreamControl(
        CursorStore(redis.Redis.from_url(env["redis_url"]), stream, prefix=env["prefix"])
    )


def insert_events(engine: sa.Engine, n: int) -> None:
    events = example_metadata().tables["im_events"]
    with engine.begin() as conn:
        conn.execute(
            events.insert(),
            [{"user_id": i % 7, "kind": "msg", "payload": f"p{i}"} for i in range(n)],
        )


def test_nightly_redispatch_chains_rounds_by_watermark(airflow_env, pg_engine):
    import nightly_event_redispatch as module

    create_example_tables(pg_engine)
    insert_events(pg_engine, 430)
    dr = module.dag.test()
    assert dr.state == DagRunState.SUCCESS, states(dr)
    ranges = xcom(dr, "plan")
    assert len(ranges) == 4 and ranges[0]["lo"] is None and ranges[-1]["hi"] == 430
    totals = xcom(dr, "barrier")
    assert totals | {"watermark": None} == {
        "round_id": "r1",
        "start_key": None,
        "end_key": 430,
        "done": 430,
        "skipped": 0,
        "dead": 0,
        "watermark": None,
        "stream": "nightly_event_redispatch",
    }
    assert totals["watermark"] == 430
    with pg_engine.connect() as conn:
        assert conn.exec_driver_sql(
            "SELECT count(*), count(DISTINCT event_seq) FROM im_outbox"
        ).one() == (430, 430)

    # the next night processes only what arrived in between
    insert_events(pg_engine, 170)
    dr2 = module.dag.test()
    assert dr2.state == DagRunState.SUCCESS, states(dr2)
    totals2 = xcom(dr2, "barrier")
    assert (totals2["round_id"], totals2["start_key"], totals2["end_key"]) == ("r2", 430, 600)
    assert (totals2["done"], totals2["skipped"], totals2["dead"]) == (170, 0, 0)
    rows_read = sum(
        xcom(dr2, "traverse", map_index=i)["rows_read"] for i in range(len(xcom(dr2, "plan")))
    )
    assert rows_read == 170
    assert control(airflow_env, "nightly_event_redispatch").watermark() == 600
    with pg_engine.connect() as conn:
        assert conn.exec_driver_sql("SELECT count(*) FROM im_outbox").scalar() == 600
    assert all(s == TaskInstanceState.SUCCESS for s in states(dr2).values())
    labels = rendered_map_indexes(dr2, "traverse")
    assert labels == [f"range {r['range_id']} ({r['lo']}, {r['hi']}]" for r in xcom(dr2, "plan")]


def rendered_map_indexes(dr: Any, task_id: str) -> list[str]:
    with create_session() as session:
        dr = session.merge(dr)
        tis = sorted(
            (ti for ti in dr.get_task_instances(session=session) if ti.task_id == task_id),
            key=lambda ti: ti.map_index,
        )
        return [ti.rendered_map_index for ti in tis]


def test_order_timeout_cancel_traverses_exactly_the_shifted_data_interval(
    airflow_env, pg_engine, caplog
):
    import order_timeout_cancel as module

    create_example_tables(pg_engine)
    logical = dt.datetime(2024, 3, 5, 12, 0, tzinfo=dt.UTC)
    orders = example_metadata().tables["orders"]
    # one order a minute from 10:00 to 12:59; every fourth one already PAID; one order per minute
    # gets a twin at the same instant (equal created_at, larger id)
    rows = []
    for minute in range(180):
        at = logical - dt.timedelta(hours=2) + dt.timedelta(minutes=minute)
        rows.append({"created_at": at, "status": "PAID" if minute % 4 == 0 else "PENDING"})
        if minute % 10 == 0:
            rows.append({"created_at": at, "status": "PENDING"})
    with pg_engine.begin() as conn:
        conn.execute(orders.insert(), rows)

    dr = module.dag.test(logical_date=logical)
    assert dr.state == DagRunState.SUCCESS, states(dr)
    timeout = dt.timedelta(minutes=30)
    lo, hi = dr.data_interval_start - timeout, dr.data_interval_end - timeout
    assert hi > lo
    in_window = [r for r in rows if lo <= r["created_at"] < hi]
    pending = sum(r["status"] == "PENDING" for r in in_window)
    paid = len(in_window) - pending
    totals = xcom(dr, "barrier")
    assert (totals["done"], totals["skipped"], totals["dead"]) == (pending, paid, 0)
    assert totals["start_key"] == [lo.isoformat(), 0] and totals["end_key"] == [hi.isoformat(), 0]
    with pg_engine.connect() as conn:
        cancelled = (
            conn.execute(sa.select(orders.c.created_at).where(orders.c.status == "CANCELLED"))
            .scalars()
            .all()
        )
        still_pending = conn.execute(
            sa.select(sa.func.count()).where(orders.c.status == "PENDING")
        ).scalar()
    assert len(cancelled) == pending and all(lo <= c < hi for c in cancelled)
    assert still_pending == sum(r["status"] == "PENDING" for r in rows) - pending

    # a manual run has no data interval: the plan fails at once and says why
    caplog.clear()
    failed = module.dag.test(logical_date=None)
    assert failed.state == DagRunState.FAILED
    assert states(failed)["plan"] == TaskInstanceState.FAILED
    assert "order_timeout_cancel needs a data interval" in caplog.text


def test_sharded_rollup_summary_sees_every_shard(airflow_env, pg_engine):
    import sharded_rollup as module

    create_example_tables(pg_engine)
    sales = example_metadata().tables["sales"]
    regions = {"east": 160, "north": 40, "south": 230, "west": 70}  # skewed shard sizes
    with pg_engine.begin() as conn:
        conn.execute(
            sales.insert(),
            [
                {"region": region, "id": i, "amount_cents": (i % 13) * 100 + 25}
                for region, n in regions.items()
                for i in range(1, n + 1)
            ],
        )

    dr = module.dag.test()
    assert dr.state == DagRunState.SUCCESS, states(dr)
    totals = xcom(dr, "barrier")
    assert (totals["done"], totals["skipped"], totals["dead"]) == (sum(regions.values()), 0, 0)
    summary = xcom(dr, "summary")
    with pg_engine.connect() as conn:
        expected = {
            region: {"sales": n, "amount_cents": cents}
            for region, n, cents in conn.execute(
                sa.select(
                    sales.c.region, sa.func.count(), sa.func.sum(sales.c.amount_cents)
                ).group_by(sales.c.region)
            )
        }
        stored = conn.exec_driver_sql(
            "SELECT count(*) FROM sales_region_summary WHERE round_id = 'r1'"
        ).scalar()
    assert summary == {"round_id": "r1", "sales": sum(regions.values()), "regions": expected}
    assert stored == len(regions)
    assert len(xcom(dr, "plan")) == 4
