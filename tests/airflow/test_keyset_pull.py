"""Pull mode under ``dag.test()``: ``PlanRangesOperator(max_ranges=64, max_tasks=4)`` ->
``TraverseRangeOperator.expand_kwargs`` -> ``BarrierSensor`` closes the round; a pull task past its
time budget defers and resumes by lineage."""

from __future__ import annotations

from typing import Any

import keyset_pull_dags as kp
import pytest
import redis
import sqlalchemy as sa
from airflow.utils.state import DagRunState, TaskInstanceState
from keyset_examples_common import create_example_tables, example_metadata
from test_example_dags import rendered_map_indexes
from test_keyset_operators import task_instances, xcom

from airflow_keyset_provider.core.store.cursor_store import CursorStore
from airflow_keyset_provider.core.store.reads import stream_names

pytestmark = pytest.mark.airflow


@pytest.fixture
def events(airflow_env: dict[str, Any], pg_engine: sa.Engine) -> int:
    """``im_events`` with 300 rows (and an empty outbox) in the test's schema."""
    create_example_tables(pg_engine)
    table = example_metadata().tables["im_events"]
    with pg_engine.begin() as conn:
        conn.execute(
            table.insert(),
            [{"user_id": i % 5, "kind": "msg", "payload": f"p{i}"} for i in range(300)],
        )
        conn.exec_driver_sql("ANALYZE im_events")
    kp.RESUMED.clear()
    return 300


def outbox(engine: sa.Engine) -> tuple[int, int]:
    with engine.connect() as conn:
        row = conn.exec_driver_sql("SELECT count(*), count(DISTINCT event_seq) FROM im_outbox")
        return tuple(row.one())  # type: ignore[return-value]


def test_many_ranges_over_four_mapped_tasks_close_the_round(airflow_env, events, pg_engine):
    dr = kp.kt_pull.test()
    assert dr.state == DagRunState.SUCCESS, task_instances(dr)
    plan = xcom(dr, "plan")
    assert len(plan) == 4
    assert [(p["pull"], p["worker"], p["workers"]) for p in plan] == [
        (True, k, 4) for k in range(4)
    ]
    assert all(p["round_id"] == plan[0]["round_id"] for p in plan)
    n_ranges = xcom(dr, "plan", key="keyset_round")["ranges"]
    assert 32 < n_ranges <= 64  # exact quantiles of 300 keys: 60 ranges of 5
    tis = task_instances(dr)
    assert all(tis[f"traverse[{k}]"].state == TaskInstanceState.SUCCESS for k in range(4))
    done = [xcom(dr, "traverse", map_index=k) for k in range(4)]
    assert all(d["mode"] == "pull" for d in done)
    # the tasks coalesce (``tasks`` = 4): every range was run by a task or coalesced into one a
    # task ran (a range that was complete when a task claimed it is not listed as run)
    ran = set().union(*(d["ranges"] for d in done))
    client = redis.Redis.from_url(airflow_env["redis_url"])
    try:
        (stream,) = stream_names(client, airflow_env["prefix"])
        store = CursorStore(client, stream, prefix=airflow_env["prefix"])
        merged = {
            int(r["range_id"]): int(r["merged_into"])
            for r in store.ranges(plan[0]["round_id"])
            if r.get("merged_into")
        }
    finally:
        client.close()
    assert merged and set(merged.values()) <= ran
    assert ran | set(merged) == set(range(n_ranges)) and not ran & set(merged)
    assert sum(d["ranges_coalesced"] for d in done) == len(merged)
    assert sum(d["rows_read"] for d in done) == events  # nothing read twice
    totals = xcom(dr, "barrier")
    assert (totals["done"], totals["skipped"], totals["dead"]) == (events, 0, 0)
    assert outbox(pg_engine) == (events, events)
    labels = rendered_map_indexes(dr, "traverse")
    assert labels == [f"worker {k + 1}/4 of round {plan[0]['round_id']}" for k in range(4)]


def test_a_pull_task_past_its_budget_defers_and_resumes(airflow_env, events, pg_engine):
    dr = kp.kt_pull_budget.test()
    assert dr.state == DagRunState.SUCCESS, task_instances(dr)
    assert kp.RESUMED and set(kp.RESUMED) == {"budget"}
    tis = task_instances(dr)
    assert all(tis[f"traverse[{k}]"].try_number == 1 for k in range(2))  # deferrals, not retries
    totals = xcom(dr, "barrier")
    assert (totals["done"], totals["skipped"], totals["dead"]) == (events, 0, 0)
    assert outbox(pg_engine) == (events, events)


def test_max_tasks_caps_the_mapping_and_the_engine_caps_the_ranges(airflow_env):
    from airflow_keyset_provider import PlanRangesOperator
    from airflow_keyset_provider.core import ConfigurationError

    source = {"task_id": "p", "source_conn_id": "x", "table": "t", "key": "id"}
    plan = PlanRangesOperator(**source, max_ranges=4096, max_tasks=16)  # 4096 > max_map_length
    assert (plan.max_ranges, plan.max_tasks) == (4096, 16)
    with pytest.raises(ConfigurationError, match=r"from 1 to 1024 \(Airflow's \[core\]"):
        PlanRangesOperator(**source, max_ranges=4096)  # one task per range: the mapping caps it
    with pytest.raises(ConfigurationError, match=r"^max_tasks must be None .* from 1 to 1024"):
        PlanRangesOperator(**source, max_ranges=4096, max_tasks=2000)
    with pytest.raises(ConfigurationError, match=r"from 1 to 100000 \(the engine's limit"):
        PlanRangesOperator(**source, max_ranges=100_001, max_tasks=16)


@pytest.mark.parametrize(
    ("n", "tasks", "positions"),
    [(16, 4, [0, 4, 8, 12]), (10, 4, [0, 2, 5, 7]), (3, 4, [0, 1, 2]), (5, 1, [0])],
)
def test_pull_tasks_spread_the_first_ranges_over_the_key_order(
    n: int, tasks: int, positions: list[int]
) -> None:
    """``PlanRangesOperator(max_tasks=...)`` in pull mode: task ``k`` of ``t`` starts with the
    range ``k * n // t`` places into the key order (not the ``k``-th), so each task's first
    coalescing claim takes its own share of the round. Range ids here are deliberately not in key
    order (as after splits), so the order used must be the keys'."""
    from airflow_keyset_provider.core import Round
    from airflow_keyset_provider.core.keys import MIN_KEY, encode_key
    from airflow_keyset_provider.core.rounds.control import RangeSpec
    from airflow_keyset_provider.operators.plan import pull_tasks

    ids = [(7 * i + 3) % n for i in range(n)]  # key position i holds range id ids[i]
    bounds = [MIN_KEY, *(encode_key([10 * (i + 1)]) for i in range(n))]
    specs = [
        RangeSpec(ids[i], None if i == 0 else 10 * i, 10 * (i + 1), bounds[i], bounds[i + 1], "")
        for i in range(n)
    ]
    rnd = Round("r1", "s", None, 10 * n, specs[::-1], MIN_KEY, bounds[-1], "open")
    got = pull_tasks(rnd, tasks, {"stream": "s"})
    assert [d["range_id"] for d in got] == [ids[p] for p in positions]
    assert [(d["worker"], d["workers"], d["pull"]) for d in got] == [
        (k, len(positions), True) for k in range(len(positions))
    ]
    assert [d["hi"] for d in got] == [10 * (p + 1) for p in positions]
