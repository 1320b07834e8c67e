"""The round on the stream's asset and the ranges in the task state store, under ``dag.test()``
(real PostgreSQL, real Redis).

``dags/downstream_on_round.py``: the barrier (poke path) puts each closed round on the stream's
asset (one event, ``extra`` = the round; the asset state store's ``watermark``/``last_round``),
each traverse task mirrors its range into its task state store, and a run with ``start_key`` /
``end_key`` params re-runs one range from its start. ``kt_defer_asset``: the same from the
deferrable path (``execute_complete``). ``kt_retry``: the task state entry follows the retry.
The asset-triggered downstream run needs a scheduler: ``tests/scheduler/test_downstream_assets.py``
runs the same DAG file on a real deployment and reads everything back through the REST API.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import keyset_test_dags as kt
import pytest
import redis
import sqlalchemy as sa
from airflow.models.asset import AssetEvent, AssetModel
from airflow.models.asset_state_store import AssetStateStoreModel
from airflow.models.task_state_store import TaskStateStoreModel
from airflow.utils.session import create_session
from airflow.utils.state import DagRunState
from keyset_examples_common import create_example_tables
from test_example_dags import control, insert_events, states, xcom

from airflow_keyset_provider.core import KeysetTraversal
from airflow_keyset_provider.core.store.cursor_store import CursorStore

pytestmark = pytest.mark.airflow

PRODUCER = "events_to_outbox"


def asset_events(dag_id: str, run_id: str) -> list[dict[str, Any]]:
    with create_session() as session:
        rows = session.scalars(
            sa.select(AssetEvent)
            .where(AssetEvent.source_dag_id == dag_id, AssetEvent.source_run_id == run_id)
            .order_by(AssetEvent.id)
        ).all()
        return [{"asset": e.asset.name, "task": e.source_task_id, "extra": e.extra} for e in rows]


def asset_state(name: str) -> dict[str, Any]:
    with create_session() as session:
        asset_id = session.scalar(sa.select(AssetModel.id).where(AssetModel.name == name))
        rows = session.execute(
            sa.select(AssetStateStoreModel.key, AssetStateStoreModel.value).where(
                AssetStateStoreModel.asset_id == asset_id
            )
        ).all()
        return {k: json.loads(v) for k, v in rows}


def published(name: str) -> dict[str, Any]:
    """The asset state the barrier publishes for users (without the stream's durable record,
    ``airflow_keyset_provider.durable_record``'s ``keyset_*`` keys)."""
    return {k: v for k, v in asset_state(name).items() if not k.startswith("keyset_")}


def task_state(dr: Any, task_id: str, map_index: int) -> dict[str, Any]:
    with create_session() as session:
        rows = session.execute(
            sa.select(TaskStateStoreModel.key, TaskStateStoreModel.value).where(
                TaskStateStoreModel.dag_id == dr.dag_id,
                TaskStateStoreModel.run_id == dr.run_id,
                TaskStateStoreModel.task_id == task_id,
                TaskStateStoreModel.map_index == map_index,
            )
        ).all()
        return {k: json.loads(v) for k, v in rows}


def without_time(entry: dict[str, Any]) -> dict[str, Any]:
    assert entry.pop("updated_at")
    return entry


def test_closed_round_goes_to_the_asset_and_each_range_to_its_task_state(airflow_env, pg_engine):
    import downstream_on_round as module

    create_example_tables(pg_engine)
    insert_events(pg_engine, 230)
    dr = module.producer.test()
    assert dr.state == DagRunState.SUCCESS, states(dr)
    round_1 = {
        "round_id": "r1",
        "start_key": None,
        "end_key": 230,
        "done": 230,
        "skipped": 0,
        "dead": 0,
        "stream": PRODUCER,
        "watermark": 230,
    }
    assert xcom(dr, "barrier") == round_1
    # one event, from the barrier (never from the mapped traverse tasks), extra = the round
    assert asset_events(PRODUCER, dr.run_id) == [
        {"asset": f"keyset://{PRODUCER}", "task": "barrier", "extra": round_1}
    ]
    assert published(f"keyset://{PRODUCER}") == {"watermark": 230, "last_round": round_1}
    # each traverse task instance mirrors its range as Redis holds it
    ranges = xcom(dr, "plan")
    assert len(ranges) == 4
    for spec in ranges:
        entry = without_time(task_state(dr, "traverse", spec["range_id"])["keyset_range"])
        assert entry == {
            "stream": PRODUCER,
            "round_id": "r1",
            "range_id": spec["range_id"],
            "lo": spec["lo"],
            "hi": spec["hi"],
            "try_number": 1,
            "authority": "redis",
            "cursor": spec["hi"],
            "done": spec["hi"] - (spec["lo"] or 0),
            "skipped": 0,
            "dead": 0,
            "retries": 0,
            "complete": True,
        }

    # Re-run range 1 from its start: trigger with its bounds as params. A new round with explicit
    # bounds delivers every key of the range again (the outbox already has them: skipped); the
    # watermark stays; the report's asset gets the new round.
    lo, hi = ranges[1]["lo"], ranges[1]["hi"]
    rerun = module.producer.test(run_conf={"start_key": lo, "end_key": hi})
    assert rerun.state == DagRunState.SUCCESS, states(rerun)
    round_2 = {
        "round_id": "r2",
        "start_key": lo,
        "end_key": hi,
        "done": 0,
        "skipped": hi - lo,
        "dead": 0,
        "stream": PRODUCER,
        "watermark": 230,
    }
    assert xcom(rerun, "barrier") == round_2
    assert [e["extra"] for e in asset_events(PRODUCER, rerun.run_id)] == [round_2]
    assert published(f"keyset://{PRODUCER}") == {"watermark": 230, "last_round": round_2}
    assert control(airflow_env, PRODUCER).watermark() == 230
    rows_read = sum(
        xcom(rerun, "traverse", map_index=r["range_id"])["rows_read"] for r in xcom(rerun, "plan")
    )
    assert rows_read == hi - lo


def test_deferred_barrier_puts_the_round_on_its_asset(airflow_env, pg_engine, pg_schema_url):
    """The barrier defers before the round is traversed (by a thread, as workers elsewhere would);
    the round closes in ``execute_complete``, whose try must still emit the event and the state."""
    create_example_tables(pg_engine)
    insert_events(pg_engine, 120)
    kt.reset()
    stream, prefix = "kt_defer_asset", airflow_env["prefix"]
    client = redis.Redis.from_url(airflow_env["redis_url"])
    channel = CursorStore(client, stream, prefix=prefix).events_channel
    errors: list[BaseException] = []

    def workers_elsewhere() -> None:
        try:
            deadline = time.monotonic() + 60
            while client.pubsub_numsub(channel)[0][1] == 0:  # until the trigger listens
                assert time.monotonic() < deadline, "the barrier never deferred to its trigger"
                time.sleep(0.05)
            t = KeysetTraversal(
                pg_schema_url,
                "im_events",
                "seq",
                airflow_env["redis_url"],
                stream=stream,
                key_prefix=prefix,
            )
            for spec in t.round("r1").ranges:
                t.traverse("r1", spec.range_id, lambda chunk: None, chunk_size=100)
            t.close()
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=workers_elsewhere, daemon=True)
    thread.start()
    dr = kt.kt_defer_asset.test()
    thread.join(30)
    assert not errors, errors
    assert dr.state == DagRunState.SUCCESS, (states(dr), kt.FAILURES)
    expected = {
        "round_id": "r1",
        "start_key": None,
        "end_key": 120,
        "done": 120,
        "skipped": 0,
        "dead": 0,
        "stream": stream,
        "watermark": 120,
    }
    assert asset_events("kt_defer_asset", dr.run_id) == [
        {"asset": f"keyset://{stream}", "task": "barrier", "extra": expected}
    ]
    assert published(f"keyset://{stream}") == {"watermark": 120, "last_round": expected}


def test_the_task_state_entry_follows_a_retry(airflow_env, pg_engine):
    """``kt_retry``: range 0's first try dies after 2 committed chunks; the entry of that task
    instance (the store survives retries) ends with try 2's state: complete at ``hi``."""
    create_example_tables(pg_engine)
    insert_events(pg_engine, 300)
    kt.reset()
    dr = kt.kt_retry.test()
    assert dr.state == DagRunState.SUCCESS, states(dr)
    spec = next(r for r in xcom(dr, "plan") if r["range_id"] == 0)
    entry = without_time(task_state(dr, "traverse", 0)["keyset_range"])
    assert (entry["try_number"], entry["cursor"], entry["complete"]) == (2, spec["hi"], True)
    # the replayed chunk (its outbox rows already written by try 1) is counted as skipped
    assert (entry["done"], entry["skipped"], entry["dead"]) == (spec["hi"] - 20, 20, 0)
