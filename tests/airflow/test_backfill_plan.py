"""A backfill of a chained stream is refused at plan time, never green and empty (issue 30 item 5).

``PlanRangesOperator.execute`` runs with the context of a backfill DAG run (``run_type``
``backfill``, what ``airflow backfill create`` makes) against a real SQLite source and Redis. Not run
under a real scheduler with ``airflow backfill create`` (too heavy for this change's budget): the
run type is the only thing the refusal reads from the run.

- A chained plan (no ``start_key``) in a backfill run fails at once (``AirflowFailException``: no
  retry can fix it) naming the fix, explicit bounds from the data interval, and writes nothing:
  the stream's open round is not reused, no new round is planned. The old plan returned the open
  round and the backfill runs succeeded having done nothing.
- The same plan in a scheduled run, and a plan with explicit bounds in a backfill run, plan as
  before.
- A scheduled run whose chained plan reuses the open round another run planned says so: the
  round XCom's ``planned_by`` names that run (None when the plan created the round, and the plan's
  own key when the same run's plan is cleared), and the plan logs a warning naming both runs.
  Before, the reuse was an info line that named no run.

Under a real scheduler with ``airflow backfill create``: ``tests/scheduler/test_backfill_scheduler.py``.
"""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest
import sqlalchemy as sa
from airflow.sdk.exceptions import AirflowFailException
from airflow.utils.types import DagRunType
from test_example_dags import control

from airflow_keyset_provider.common import ROUND_XCOM_KEY
from airflow_keyset_provider.operators.plan import PlanRangesOperator

pytestmark = pytest.mark.airflow


class TaskInstance(SimpleNamespace):
    def xcom_push(self, key: str, value: Any) -> None:
        self.pushed[key] = value


def context(run_type: DagRunType, run_id: str) -> dict[str, Any]:
    ti = TaskInstance(dag_id="nightly", run_id=run_id, task_id="plan", map_index=-1, pushed={})
    return {"dag_run": SimpleNamespace(run_type=run_type, run_id=run_id), "ti": ti}


def plan(prefix: str, **kwargs: Any) -> PlanRangesOperator:
    return PlanRangesOperator(
        task_id="plan", source_conn_id="backfill_src", table="events", key="seq",
        stream="nightly", key_prefix=prefix, max_ranges=2, **kwargs,
    )  # fmt: skip


@pytest.fixture
def source(tmp_path, monkeypatch) -> None:
    """``backfill_src``: a SQLite ``events`` table of 300 rows keyed by ``seq``."""
    db = tmp_path / "source.db"
    monkeypatch.setenv(
        "AIRFLOW_CONN_BACKFILL_SRC", json.dumps({"conn_type": "sqlite", "host": str(db)})
    )
    engine = sa.create_engine(f"sqlite:///{db}")
    with engine.begin() as c:
        c.exec_driver_sql(
            "CREATE TABLE events (seq bigint PRIMARY KEY NOT NULL, payload text NOT NULL)"
        )
        c.execute(sa.text("INSERT INTO events VALUES (:s, 'e')"), [{"s": k} for k in range(1, 301)])
    engine.dispose()


def test_a_backfill_of_a_chained_stream_is_refused_with_the_fix(airflow_env, source):
    prefix = airflow_env["prefix"]
    ranges = plan(prefix, new_stream=True).execute(
        context(DagRunType.SCHEDULED, "scheduled__2026-12-01")
    )
    assert {r["round_id"] for r in ranges} == {"r1"}  # the chained round, open

    for run in ("backfill__2026-11-01", "backfill__2026-11-02"):
        with pytest.raises(AirflowFailException) as err:
            plan(prefix).execute(context(DagRunType.BACKFILL_JOB, run))
        msg = str(err.value)
        assert "backfill run" in msg and "start_key='{{ data_interval_start }}'" in msg, msg
        assert "docs/howto-backfills.md" in msg
    ctl = control(airflow_env, "nightly")
    assert ctl.stream_status().rounds_planned == 1  # nothing planned, r1 not handed out again

    explicit = plan(prefix, start_key=100, end_key=200)
    ranges = explicit.execute(context(DagRunType.BACKFILL_JOB, "backfill__2026-11-03"))
    assert {r["round_id"] for r in ranges} == {"r2"}
    assert ctl.round("r2").start_key == 100 and ctl.round("r2").end_key == 200


def test_a_run_reusing_another_runs_open_round_is_told_which(airflow_env, source, capsys):
    prefix = airflow_env["prefix"]

    def run(run_id: str, **kwargs: Any) -> dict[str, Any]:
        ctx = context(DagRunType.SCHEDULED, run_id)
        plan(prefix, **kwargs).execute(ctx)
        return ctx["ti"].pushed[ROUND_XCOM_KEY]

    first = run("scheduled__2026-12-01", new_stream=True)
    assert (first["round_id"], first["planned_by"]) == ("r1", None)
    assert run("scheduled__2026-12-01")["planned_by"] == "nightly/scheduled__2026-12-01/plan"
    assert "planned by" not in capsys.readouterr().out  # the same run's plan, cleared: no warning

    second = run("scheduled__2026-12-02")  # r1 is still open: this run continues it
    assert (second["round_id"], second["planned_by"]) == (
        "r1",
        "nightly/scheduled__2026-12-01/plan",
    )
    warning = (  # the operator's log (structlog, on stdout outside a task runner)
        "round r1 is the stream's open round, planned by nightly/scheduled__2026-12-01/plan, "
        "not by this run (nightly/scheduled__2026-12-02/plan)"
    )
    assert warning in capsys.readouterr().out
