"""``execution_timeout`` under ``dag.test()`` (issue #18 item 6): a try ended by the timeout ends
at a chunk boundary with everything it processed committed, so no key is delivered twice."""

from __future__ import annotations

from typing import Any

import keyset_timeout_dags as kto
import pytest
import sqlalchemy as sa
from airflow.models.xcom import XComModel
from airflow.utils.session import create_session
from airflow.utils.state import DagRunState
from keyset_examples_common import create_example_tables, example_metadata

pytestmark = pytest.mark.airflow


def _xcom(dr: Any, task_id: str, map_index: int = -1) -> Any:
    with create_session() as session:
        row = session.scalars(
            XComModel.get_many(
                run_id=dr.run_id,
                dag_ids=dr.dag_id,
                task_ids=task_id,
                key="return_value",
                map_indexes=map_index,
            )
        ).first()
        return None if row is None else XComModel.deserialize_value(row)


def _try_number(dr: Any) -> int:
    with create_session() as session:
        dr = session.merge(dr)
        (ti,) = [ti for ti in dr.get_task_instances(session=session) if ti.task_id == "traverse"]
        return ti.try_number


def test_a_try_ended_by_execution_timeout_commits_what_it_processed(
    airflow_env: dict[str, Any], pg_engine: sa.Engine
) -> None:
    """300 keys, chunks of 10 taking 0.1 s each, ``execution_timeout`` 3 s: about 3 s of work, so
    the range needs more than one try. Before: Airflow's alarm landed inside a processor call,
    the run released the lease without committing and ``on_kill`` found the traversal gone, so
    each timeout delivered its chunk again. Now the operator gives the engine a budget that ends
    a second before the alarm; each try stops at a chunk boundary, commits, fails as timed out,
    and the retry resumes from the cursor: every key is delivered exactly once."""
    create_example_tables(pg_engine)
    table = example_metadata().tables["im_events"]
    with pg_engine.begin() as conn:
        conn.execute(
            table.insert(),
            [{"user_id": i % 5, "kind": "msg", "payload": f"p{i}"} for i in range(300)],
        )
    kto.reset()
    dr = kto.kt_timeout.test()
    assert dr.state == DagRunState.SUCCESS, kto.RETRIES
    assert _try_number(dr) > 1 and kto.RETRIES, "no try was ended by the timeout"
    assert all(r.startswith("AirflowTaskTimeout") for r in kto.RETRIES), kto.RETRIES
    res = _xcom(dr, "traverse", map_index=0)
    assert res["complete"] and res["done"] == 300
    assert set(kto.DELIVERED) == set(range(1, 301))
    twice = sorted(k for k, n in kto.DELIVERED.items() if n > 1)
    assert twice == [], f"delivered again after a timeout: {twice}"
    print(f"\n{_try_number(dr)} tries, each ended by execution_timeout but the last; 0 replays")
