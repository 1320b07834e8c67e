"""A retry or clear of ``PlanRangesOperator`` returns exactly what its first run returned, even after
the round ran (issue #18, item 5): docs/howto-retries-and-clears.md promises "same id, same bounds,
same ranges". A clear of the plan task runs ``execute`` again with the same run id (the round key),
as these tests do.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import sqlalchemy as sa
from keyset_examples_common import create_example_tables, example_metadata

from airflow_keyset_provider import PlanRangesOperator
from airflow_keyset_provider.core import KeysetTraversal, TraverseOptions

pytestmark = pytest.mark.airflow


@pytest.fixture
def events(airflow_env: dict[str, Any], pg_engine: sa.Engine) -> int:
    """``im_events`` with 300 rows in the test's schema, analyzed."""
    create_example_tables(pg_engine)
    table = example_metadata().tables["im_events"]
    with pg_engine.begin() as conn:
        conn.execute(
            table.insert(),
            [{"user_id": i % 5, "kind": "msg", "payload": f"p{i}"} for i in range(300)],
        )
        conn.exec_driver_sql("ANALYZE im_events")
    return 300


def _plan(env: dict[str, Any], stream: str, **kw: Any) -> tuple[PlanRangesOperator, Any]:
    op = PlanRangesOperator(
        task_id="plan",
        source_conn_id="keyset_examples_db",
        table="im_events",
        key="seq",
        stream=stream,
        key_prefix=env["prefix"],
        new_stream=True,  # called outside a task runner: no Airflow record to tell it is new
        **kw,
    )
    return op, lambda try_number: {
        "ti": SimpleNamespace(
            dag_id="kt_replay",
            run_id="manual__1",
            task_id="plan",
            map_index=-1,
            try_number=try_number,
            xcom_push=lambda **_: None,
        )
    }


def _engine(env: dict[str, Any], schema_url: str, stream: str) -> KeysetTraversal:
    return KeysetTraversal(
        schema_url,
        table="im_events",
        key="seq",
        redis_url=env["redis_url"],
        stream=stream,
        key_prefix=env["prefix"],
    )


def test_clearing_a_pull_plan_after_the_round_ran_returns_the_first_answer(
    airflow_env, events, pg_schema_url
):
    """Scenario: plan a pull round (16 ranges, 4 tasks); one task pulls it all: its first claim
    coalesces the ranges that follow into its own (its ``hi`` moves up, theirs become empty), an
    idle task asks it to split (a new range appears, its ``hi`` moves down); the round closes.
    Clearing the plan task then runs ``execute`` again: it must return the first answer (old code:
    the dicts were rebuilt from the current ranges, e.g. range 0's ``hi`` 19 became 43)."""
    op, context = _plan(airflow_env, "replay-pull", max_ranges=16, max_tasks=4)
    first = op.execute(context(1))
    assert len(first) == 4 and {d["round_id"] for d in first} == {"r1"}
    t, ghost = (_engine(airflow_env, pg_schema_url, "replay-pull") for _ in range(2))
    asked: list[str] = []

    def proc(chunk: Any) -> None:
        if not asked and chunk.range_id == first[0]["range_id"]:  # an idle task asks to split
            asked.append(ghost.store.request_split("r1", chunk.range_id, "idle#1"))

    try:
        res = t.traverse_round(
            "r1",
            proc,
            options=TraverseOptions(owner_lineage="w0", chunk_size=5),
            first_range=first[0]["range_id"],
            tasks=4,
        )
        assert res.finished and asked == ["asked"]
        info = t.store.round_info("r1")
        assert int(info["n_ranges"]) > 16  # the split appended a range
        assert any(r.get("merged_into") for r in t.store.ranges("r1"))  # coalesced
        assert t.close_round("r1").done == events
    finally:
        t.close()
        ghost.close()
    assert op.execute(context(2)) == first
    assert op.execute(context(3)) == first


def test_clearing_a_one_range_per_task_plan_after_the_round_ran_returns_the_first_answer(
    airflow_env, events, pg_schema_url
):
    """One range per mapped task: no claim coalesces and no range splits there (``traverse``
    declines), so the ranges keep their bounds; a clear after the round closed returns the same
    dicts."""
    op, context = _plan(airflow_env, "replay-push", max_ranges=4)
    first = op.execute(context(1))
    assert len(first) == 4
    t = _engine(airflow_env, pg_schema_url, "replay-push")
    try:
        for d in first:
            assert t.traverse(d["round_id"], d["range_id"], lambda chunk: None).complete
        assert t.close_round("r1").done == events
    finally:
        t.close()
    assert op.execute(context(2)) == first
