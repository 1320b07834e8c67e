"""Durable by default under ``dag.test()``: Redis loses a stream that has no checkpoint mirror.

DAG ``kt_durable`` (``keyset_test_dags.py``): plan -> mapped traverse -> barrier, no mirror, no
outlets. The plan declares ``keyset://kt_durable`` as an inlet; the barrier records each close in
that asset's state store and the plan each chained round (``airflow_keyset_provider.
durable_record``). Redis loses the stream by deleting its keys under the examples' prefix (never a
flush of the shared database). On the old code the run after the loss planned ``(-inf, max]``
again: the 300 keys of the first run were delivered a second time, and mid-round the committed
chunks of the open round came again."""

from __future__ import annotations

from typing import Any

import keyset_test_dags as kt
import pytest
import sqlalchemy as sa
from airflow.utils.state import DagRunState
from keyset_examples_common import create_example_tables, example_metadata
from test_downstream_example import asset_state
from test_keyset_operators import control, task_instances, xcom

pytestmark = pytest.mark.airflow


def _insert(engine: sa.Engine, n: int) -> None:
    table = example_metadata().tables["im_events"]
    with engine.begin() as conn:
        conn.execute(
            table.insert(),
            [{"user_id": i % 5, "kind": "msg", "payload": f"p{i}"} for i in range(n)],
        )


@pytest.fixture
def events(airflow_env: dict[str, Any], pg_engine: sa.Engine) -> int:
    create_example_tables(pg_engine)
    _insert(pg_engine, 300)
    kt.reset()
    kt.SEEN.clear()
    kt.LOSE_AT.clear()
    return 300


def test_a_stream_redis_lost_is_restored_from_airflows_records(airflow_env, events, pg_engine):
    """Run 1 (a stream Airflow never planned: new) closes (0, 300]; Redis loses the stream; run 2
    restores the watermark from the asset state and traverses only the 50 new keys (r2 (300,
    350]): no key is delivered twice."""
    first = kt.kt_durable.test()
    assert first.state == DagRunState.SUCCESS, (task_instances(first), kt.FAILURES)
    assert kt.forget_stream("kt_durable") > 0  # Redis lost the stream
    assert control(airflow_env, "kt_durable").store.has_state() is False
    _insert(pg_engine, 50)
    second = kt.kt_durable.test()
    assert second.state == DagRunState.SUCCESS, (task_instances(second), kt.FAILURES)
    totals = xcom(second, "barrier")
    assert (totals["round_id"], totals["start_key"], totals["end_key"]) == ("r2", 300, 350)
    assert sorted(kt.SEEN) == list(range(1, 351))
    assert max(kt.SEEN.values()) == 1, "a key was delivered twice after the loss"
    assert control(airflow_env, "kt_durable").watermark() == 350
    state = asset_state("keyset://kt_durable")  # the record the next loss restores from
    assert state["keyset_closed"]["round_id"] == "r2"
    assert state["keyset_planned"]["round_id"] == "r2"


def test_a_round_redis_lost_mid_way_is_refused_not_replayed(airflow_env, events, pg_engine):
    """Run 1 closes (0, 300]. Run 2's round r2 (300, 400] loses Redis after range 0 committed two
    chunks: its traverse fails (``RoundStateLostError``). The next run's plan refuses with
    ``StreamStateLostError`` naming r2, its bounds and the choices, instead of planning r2's keys
    again and delivering its committed chunks a second time; nothing is traversed."""
    first = kt.kt_durable.test()
    assert first.state == DagRunState.SUCCESS, (task_instances(first), kt.FAILURES)
    _insert(pg_engine, 100)
    kt.LOSE_AT["chunks"] = 2
    second = kt.kt_durable.test()
    assert second.state == DagRunState.FAILED
    assert any("RoundStateLostError" in v for v in kt.FAILURES.values()), kt.FAILURES
    delivered = sum(kt.SEEN.values())
    kt.FAILURES.clear()
    third = kt.kt_durable.test()
    assert third.state == DagRunState.FAILED
    refusal = kt.FAILURES.get("plan", "")
    assert "StreamStateLostError" in refusal and "round r2 (300, 400] was open" in refusal
    for choice in ("checkpoint mirror", "explicit bounds", "new_stream=True"):
        assert choice in refusal, refusal
    assert sum(kt.SEEN.values()) == delivered, "the refused plan traversed keys again"
    assert control(airflow_env, "kt_durable").store.has_state() is False  # nothing written


def test_a_record_written_before_the_durable_keys_restores_too(airflow_env, events, pg_engine):
    """A deployment upgraded from a version whose barrier published only ``last_round`` (with an
    asset outlet; keys as ``to_json`` renders them) keeps its protection: the plan encodes that
    watermark and restores it."""
    first = kt.kt_durable.test()
    assert first.state == DagRunState.SUCCESS, (task_instances(first), kt.FAILURES)
    _as_before_upgrade("keyset://kt_durable", {"round_id": "r1", "watermark": 300})
    kt.forget_stream("kt_durable")
    _insert(pg_engine, 20)
    second = kt.kt_durable.test()
    assert second.state == DagRunState.SUCCESS, (task_instances(second), kt.FAILURES)
    totals = xcom(second, "barrier")
    assert (totals["round_id"], totals["start_key"], totals["end_key"]) == ("r2", 300, 320)
    assert max(kt.SEEN.values()) == 1


def _as_before_upgrade(name: str, last_round: dict[str, Any]) -> None:
    """The asset state as the older barrier left it: ``last_round`` only."""
    import json

    from airflow.models.asset import AssetModel
    from airflow.models.asset_state_store import AssetStateStoreModel
    from airflow.utils.session import create_session

    with create_session() as session:
        asset_id = session.scalar(sa.select(AssetModel.id).where(AssetModel.name == name))
        session.execute(
            sa.delete(AssetStateStoreModel).where(AssetStateStoreModel.asset_id == asset_id)
        )
        session.add(
            AssetStateStoreModel(asset_id=asset_id, key="last_round", value=json.dumps(last_round))
        )
