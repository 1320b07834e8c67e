"""The docs' approval example, ``dags/approved_order_cancellation.py`` exactly as the docs show it,
under a real Airflow deployment (scheduler with LocalExecutor, DAG processor, triggerer, API
server: ``deployment_support``): ``preview >> approve >> plan >> traverse >> barrier``.

The test triggers a run through the REST API, waits until ``approve`` (Airflow's own
``ApprovalOperator``) waits for input, reads its Human-in-the-loop detail (the body is the
preview's Markdown: rows, plan, the processor's verdict on the sample), and answers through the
api-server's HITL endpoint:

- Approve: the round runs; every PENDING order is cancelled, the barrier's totals are exact.
- Reject: plan, traverse and barrier are skipped; the table and every Redis key of the test's
  prefix are exactly what they were before the run (the preview wrote nothing either).
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import deployment_support as ds
import pytest
import redis
import sqlalchemy as sa
from scheduler_support import FIGURES, AirflowDeployment

REPO = Path(__file__).resolve().parents[2]
DAG_ID = "approved_order_cancellation"
ROWS = 900
RUN_TIMEOUT_S = 240.0
POLL_S = 1.0


def _dags_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "dags"
    folder.mkdir()
    for name in ("approved_order_cancellation.py", "keyset_examples_common.py"):
        (folder / name).symlink_to(REPO / "dags" / name)
    return folder


def _create_orders(engine: sa.Engine) -> None:
    with engine.begin() as c:
        c.exec_driver_sql(
            "CREATE TABLE orders (id bigint PRIMARY KEY, created_at timestamptz NOT NULL, "
            "status text NOT NULL)"
        )
        c.exec_driver_sql("CREATE UNIQUE INDEX orders_created_at_id ON orders (created_at, id)")
        c.execute(
            sa.text("INSERT INTO orders (id, created_at, status) VALUES (:i, :t, :s)"),
            [
                {
                    "i": i,
                    "t": dt.datetime(2026, 3, 1, tzinfo=dt.UTC) + dt.timedelta(seconds=i),
                    "s": "PAID" if i % 5 == 0 else "PENDING",
                }
                for i in range(1, ROWS + 1)
            ],
        )
        c.exec_driver_sql("ANALYZE orders")


def _orders(engine: sa.Engine) -> list[tuple]:
    with engine.connect() as c:
        return [tuple(r) for r in c.exec_driver_sql("SELECT * FROM orders ORDER BY id")]


def _redis(redis_url: str, prefix: str) -> dict[bytes, Any]:
    client = redis.Redis.from_url(redis_url)
    try:
        return {k: client.dump(k) for k in client.scan_iter(match=f"{prefix}:*", count=1000)}
    finally:
        client.close()


def _start(
    airflow_deployment: Callable[[Mapping[str, str], str], AirflowDeployment],
    tmp_path: Path,
    pg_url: str,
    pg_schema: str,
    redis_url: str,
    key_prefix: str,
) -> AirflowDeployment:
    return airflow_deployment(
        {
            "AIRFLOW__CORE__DAGS_FOLDER": str(_dags_folder(tmp_path)),
            "AIRFLOW_CONN_KEYSET_EXAMPLES_DB": ds.postgres_conn(pg_url, pg_schema),
            "AIRFLOW_CONN_REDIS_DEFAULT": ds.redis_conn(redis_url),
            "KEYSET_EXAMPLE_KEY_PREFIX": key_prefix,
            "KEYSET_EXAMPLE_MAX_RANGES": "2",
            "KEYSET_EXAMPLE_CHUNK_SIZE": "100",
            "KEYSET_EXAMPLE_POKE_INTERVAL": "2",
            "KEYSET_EXAMPLE_RETRY_DELAY_SECONDS": "2",
        },
        DAG_ID,
    )


def _fail(dep: AirflowDeployment, what: str) -> None:
    pytest.fail(f"{what}\n{dep.diagnostics(DAG_ID)}")


def _await_approval(dep: AirflowDeployment) -> tuple[str, dict[str, Any]]:
    """Trigger a run; once ``approve`` waits for input, its run id and HITL detail."""
    run_id = dep.request("POST", f"/dags/{DAG_ID}/dagRuns", {"logical_date": None})["dag_run_id"]
    hitl = f"{ds.ti_path(DAG_ID, run_id, 'approve')}/-1/hitlDetails"
    end = time.monotonic() + RUN_TIMEOUT_S
    while time.monotonic() < end:
        if dep.dead_components():
            _fail(dep, f"Airflow components died: {dep.dead_components()}")
        ti = ds.get_or_none(dep, ds.ti_path(DAG_ID, run_id, "approve"))
        if ti is not None and ti["state"] in ("failed", "upstream_failed", "skipped"):
            _fail(dep, f"approve ended {ti['state']} before any answer")
        if ti is not None and ti["state"] in ("awaiting_input", "deferred"):
            detail = ds.get_or_none(dep, hitl)
            if detail is not None and _parked(dep):
                return run_id, detail
        time.sleep(POLL_S)
    _fail(dep, "approve never waited for input")
    raise AssertionError  # unreachable


def _parked(dep: AirflowDeployment) -> bool:
    """The scheduler has processed the executor's event of the process that parked ``approve``
    in ``awaiting_input``. Airflow 3.3 race, seen here: an answer given before that event is
    processed resumes the task at once, and the late event of the parking process ("finished with
    state success, but the task instance's state attribute is running") then marks the resumed
    approval FAILED (its downstream is still skipped on Reject). A person answers long after;
    the test waits for the event instead of for time."""
    out = (dep.home / "scheduler.out").read_text(errors="replace")
    return (
        "Received executor event with state success for task instance TaskInstanceKey("
        f"dag_id='{DAG_ID}', task_id='approve'"
    ) in out


def _answer(dep: AirflowDeployment, run_id: str, option: str) -> dict[str, Any]:
    """Answer the approval through the REST API; the finished run."""
    hitl = f"{ds.ti_path(DAG_ID, run_id, 'approve')}/-1/hitlDetails"
    dep.request("PATCH", hitl, {"chosen_options": [option], "params_input": {}})
    end = time.monotonic() + RUN_TIMEOUT_S
    while time.monotonic() < end:
        if dep.dead_components():
            _fail(dep, f"Airflow components died: {dep.dead_components()}")
        run = dep.get(f"/dags/{DAG_ID}/dagRuns/{run_id}")
        if run["state"] in ("success", "failed"):
            return run
        time.sleep(POLL_S)
    _fail(dep, f"run {run_id} did not finish after {option}")
    raise AssertionError  # unreachable


def _states(dep: AirflowDeployment, run_id: str) -> dict[str, str]:
    tis = dep.get(f"/dags/{DAG_ID}/dagRuns/{run_id}/taskInstances")["task_instances"]
    return {
        (t["task_id"] if t["map_index"] < 0 else f"{t['task_id']}[{t['map_index']}]"): t["state"]
        for t in tis
    }


def _check_preview_shown(detail: dict[str, Any]) -> None:
    pending = ROWS - ROWS // 5
    body = detail["body"] or ""
    assert detail["options"] == ["Approve", "Reject"]
    assert "stale orders?" in detail["subject"]
    assert "**Rows**" in body and "**Chunk query**: index range" in body, body
    assert "rolled back" in body and "applied" in body, body
    assert "ETA" in body, body
    assert pending > 0


def test_approved_the_round_runs(
    airflow_deployment: Callable[[Mapping[str, str], str], AirflowDeployment],
    tmp_path: Path,
    pg_url: str,
    pg_schema: str,
    pg_engine: sa.Engine,
    redis_url: str,
    key_prefix: str,
) -> None:
    _create_orders(pg_engine)
    started = time.monotonic()
    dep = _start(airflow_deployment, tmp_path, pg_url, pg_schema, redis_url, key_prefix)
    run_id, detail = _await_approval(dep)
    _check_preview_shown(detail)
    preview = ds.xcom(dep, DAG_ID, run_id, "preview", "return_value")
    assert preview["processor"]["ran"] and preview["processor"]["rolled_back"]
    assert preview["chunk_plan"]["scan"] == "index range", preview["chunk_plan"]
    assert all(s == "PENDING" or i % 5 == 0 for i, _, s in _orders(pg_engine))  # still
    run = _answer(dep, run_id, "Approve")
    assert run["state"] == "success", f"{run} {_states(dep, run_id)}\n{dep.diagnostics(DAG_ID)}"
    totals = ds.xcom(dep, DAG_ID, run_id, "barrier", "return_value")
    pending = ROWS - ROWS // 5
    assert (totals["done"], totals["skipped"], totals["dead"]) == (pending, 0, 0)
    assert totals["verification"]["state"] == "verified", totals  # no order still PENDING
    with pg_engine.connect() as c:
        counts = dict(c.exec_driver_sql("SELECT status, count(*) FROM orders GROUP BY 1").all())
    assert counts == {"CANCELLED": pending, "PAID": ROWS // 5}
    FIGURES.append(
        f"approval example, approved: preview ETA {preview['eta']['seconds']} s for "
        f"~{preview['estimated_rows']} rows; {pending} orders cancelled, run success "
        f"{time.monotonic() - started:.0f} s after the deployment started"
    )


def test_rejected_nothing_is_traversed(
    airflow_deployment: Callable[[Mapping[str, str], str], AirflowDeployment],
    tmp_path: Path,
    pg_url: str,
    pg_schema: str,
    pg_engine: sa.Engine,
    redis_url: str,
    key_prefix: str,
) -> None:
    _create_orders(pg_engine)
    dep = _start(airflow_deployment, tmp_path, pg_url, pg_schema, redis_url, key_prefix)
    before = (_orders(pg_engine), _redis(redis_url, key_prefix))
    run_id, detail = _await_approval(dep)
    _check_preview_shown(detail)
    run = _answer(dep, run_id, "Reject")
    states = _states(dep, run_id)
    assert run["state"] == "success", f"{run} {states}"
    assert states["preview"] == "success" and states["approve"] == "success", states
    assert {states[t] for t in states if t.split("[")[0] in ("plan", "traverse", "barrier")} == {
        "skipped"
    }, states
    assert (_orders(pg_engine), _redis(redis_url, key_prefix)) == before
    FIGURES.append(
        "approval example, rejected: plan, traverse and barrier skipped; nothing written"
    )
