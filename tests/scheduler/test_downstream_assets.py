"""Downstream DAGs on a closed round, and the state stores, on a real Airflow 3.3 deployment.

The deployment (``conftest.py``: scheduler with LocalExecutor, DAG processor, triggerer, API
server, throwaway home and metadata database) parses a DAGs folder holding the example
``dags/downstream_on_round.py`` (with ``keyset_examples_common.py``) and
``dags_assets/keyset_assets_deferred.py``. Everything is read back through the REST API, as an
operator (or the UI) would.

1. ``events_to_outbox`` (poke barrier) traverses ``ROWS`` events in two ranges; the scheduler then
   runs ``outbox_round_report`` because the barrier's outlet ``keyset://<stream>`` got an event.
   Checked: the report's run is asset-triggered and its XCom holds the round exactly as the
   barrier closed it (``round_id``, bounds, counters) with the outbox rows it found; the asset
   event (``/assets/events``) carries the same ``extra`` and comes from the barrier only; the
   asset state store (``/assets/{id}/state-store``) holds the stream's watermark; each traverse
   task instance's task state store (``.../taskInstances/traverse/state-store?map_index=i``)
   holds its range complete at ``hi``.
2. Re-running range 1 from its start, as from the UI's "Trigger DAG w/ config": a run with conf
   ``start_key``/``end_key`` = the range's bounds re-delivers every key of the range (skipped:
   the outbox has them), leaves the watermark, and triggers the report again with that round.
3. ``keyset_assets_deferred``: the barrier defers to the real triggerer while the range runs and
   closes the round in ``execute_complete`` on a worker; its report gets the event as well.
4. Clearing a complete traverse task (``clearTaskInstances``, as the UI's Clear does): try 2 of the
   same task instance claims the range, finds it complete at its cursor and reads nothing; the
   task state entry survives and now shows try 2; no new asset event (the barrier was not cleared).
5. Clearing the barrier (once the run has finished again: Airflow's clear resets only a finished
   run, and a clear that lands while the scheduler is finishing the run is lost, the run ending
   "success" with the barrier never run): try 2 closes the closed round again (same totals) and
   emits the same round again, so the report runs again for ``r1``: consumers see a round at
   least once.
"""

from __future__ import annotations

import time
import urllib.error
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import quote

import deployment_support as ds
import pytest
import redis
import sqlalchemy as sa
from scheduler_support import FIGURES, AirflowDeployment

from airflow_keyset_provider.core import StreamControl
from airflow_keyset_provider.core.store.cursor_store import CursorStore

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
PRODUCER, REPORT = "events_to_outbox", "outbox_round_report"
DEFERRED, DEFERRED_REPORT = "keyset_assets_deferred", "keyset_assets_deferred_report"
ROWS = 400
RUN_TIMEOUT_S = 120.0
SOURCE_CONN, REDIS_CONN = "keyset_assets_db", "keyset_assets_redis"


def _dags_folder(tmp_path: Path) -> Path:
    """The example DAG file itself (the docs include it), its common module, the deferred DAG."""
    folder = tmp_path / "dags"
    folder.mkdir()
    for source in (
        REPO / "dags" / "downstream_on_round.py",
        REPO / "dags" / "keyset_examples_common.py",
        HERE / "dags_assets" / "keyset_assets_deferred.py",
    ):
        (folder / source.name).symlink_to(source)
    return folder


def _create_events(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        conn.exec_driver_sql(
            "CREATE TABLE im_events (seq bigint PRIMARY KEY, user_id bigint NOT NULL, "
            "kind text NOT NULL, payload text NOT NULL)"
        )
        conn.exec_driver_sql(
            "CREATE TABLE im_outbox (event_seq bigint PRIMARY KEY, user_id bigint NOT NULL, "
            "kind text NOT NULL, payload text NOT NULL)"
        )
        conn.exec_driver_sql(
            f"INSERT INTO im_events SELECT g, mod(g, 7), 'msg', 'p' || g "
            f"FROM generate_series(1, {ROWS}) g"
        )
        conn.exec_driver_sql("ANALYZE im_events")


# --------------------------------------------------------------------------- REST helpers


def _wait_for_dags(dep: AirflowDeployment, dag_ids: list[str]) -> None:
    end = time.monotonic() + 60
    missing = list(dag_ids)
    while missing and time.monotonic() < end:
        for dag_id in list(missing):
            try:
                if not dep.get(f"/dags/{dag_id}").get("is_paused"):
                    missing.remove(dag_id)
            except urllib.error.HTTPError:
                pass
        time.sleep(0.5)
    assert not missing, f"DAGs never parsed/unpaused: {missing}\n{dep.diagnostics()}"


def _trigger(dep: AirflowDeployment, dag_id: str, conf: dict[str, Any] | None = None) -> str:
    run_id = f"test_{uuid.uuid4().hex[:8]}"
    dep.request(
        "POST",
        f"/dags/{dag_id}/dagRuns",
        {"dag_run_id": run_id, "logical_date": None, "conf": conf or {}},
    )
    return run_id


def _runs(dep: AirflowDeployment, dag_id: str) -> list[dict[str, Any]]:
    return dep.get(f"/dags/{dag_id}/dagRuns?order_by=run_after&limit=100")["dag_runs"]


def _wait(dep: AirflowDeployment, what: str, check: Callable[[], Any]) -> Any:
    """Poll ``check`` until it returns something truthy; fail with the deployment's logs after
    RUN_TIMEOUT_S or when a DAG run failed (``check`` raises AssertionError then)."""
    end = time.monotonic() + RUN_TIMEOUT_S
    while time.monotonic() < end:
        if dep.dead_components():
            pytest.fail(f"Airflow components died: {dep.dead_components()}\n{dep.diagnostics()}")
        try:
            result = check()
        except AssertionError as exc:
            pytest.fail(f"{what}: {exc}\n{dep.diagnostics()}")
        if result:
            return result
        time.sleep(0.5)
    pytest.fail(f"{what}: not done after {RUN_TIMEOUT_S:.0f} s\n{dep.diagnostics()}")


def _run_done(dep: AirflowDeployment, dag_id: str, run_id: str) -> Callable[[], bool]:
    def check() -> bool:
        state = dep.get(f"/dags/{dag_id}/dagRuns/{run_id}")["state"]
        assert state != "failed", f"{dag_id} run {run_id} failed"
        return state == "success"

    return check


def _reports_done(
    dep: AirflowDeployment, dag_id: str, n: int
) -> Callable[[], list[dict[str, Any]] | None]:
    """At least ``n`` runs of the report DAG, every one successful -> the runs."""

    def check() -> list[dict[str, Any]] | None:
        runs = _runs(dep, dag_id)
        assert not [r for r in runs if r["state"] == "failed"], f"a run of {dag_id} failed: {runs}"
        return runs if len(runs) >= n and all(r["state"] == "success" for r in runs) else None

    return check


def _clear(dep: AirflowDeployment, run_id: str, task_ids: list[Any]) -> None:
    """What the UI's Clear does (downstream tasks left alone)."""
    body = {
        "dry_run": False,
        "dag_run_id": run_id,
        "task_ids": task_ids,
        "only_failed": False,
        "reset_dag_runs": True,
        "include_downstream": False,
    }
    dep.request("POST", f"/dags/{PRODUCER}/clearTaskInstances", body)


def _cleared_try_done(dep: AirflowDeployment, run_id: str, map_index: int) -> Callable[[], bool]:
    def check() -> bool:
        ti = dep.get(f"/dags/{PRODUCER}/dagRuns/{run_id}/taskInstances/traverse/{map_index}")
        assert ti["state"] != "failed", f"the cleared traverse[{map_index}] failed"
        return ti["try_number"] == 2 and ti["state"] == "success"

    return check


def _reclosed(dep: AirflowDeployment, run_id: str, reports: int) -> Callable[[], Any]:
    """After the barrier of the finished run ``run_id`` was cleared: ``reports`` report runs, all
    successful. Fails at once if the clear was lost (the run finished, the barrier never ran)."""
    done = _reports_done(dep, REPORT, reports)

    def check() -> Any:
        run = dep.get(f"/dags/{PRODUCER}/dagRuns/{run_id}")["state"]
        barrier = dep.get(f"/dags/{PRODUCER}/dagRuns/{run_id}/taskInstances/barrier")["state"]
        assert not (run in ("success", "failed") and barrier is None), (
            f"the clear of the barrier was lost: run {run_id} is {run}, the barrier never ran"
        )
        return done()

    return check


def _xcom(
    dep: AirflowDeployment, dag_id: str, run_id: str, task_id: str, map_index: int | None = None
) -> Any:
    return ds.xcom(dep, dag_id, run_id, task_id, "return_value", map_index)


def _asset(dep: AirflowDeployment, name: str) -> dict[str, Any]:
    assets = dep.get(f"/assets?name_pattern={quote(name, safe='')}")["assets"]
    return next(a for a in assets if a["name"] == name)


def _asset_events(dep: AirflowDeployment, dag_id: str) -> list[dict[str, Any]]:
    return dep.get(f"/assets/events?source_dag_id={dag_id}&order_by=timestamp&limit=100")[
        "asset_events"
    ]


def _asset_state(dep: AirflowDeployment, asset_id: int) -> dict[str, Any]:
    """The asset state the barrier publishes for users, without the stream's durable record (the
    ``keyset_*`` keys of ``airflow_keyset_provider.durable_record``)."""
    entries = dep.get(f"/assets/{asset_id}/state-store")["asset_state_store"]
    return {e["key"]: e["value"] for e in entries if not e["key"].startswith("keyset_")}


def _task_state(
    dep: AirflowDeployment, dag_id: str, run_id: str, task_id: str, map_index: int
) -> dict[str, Any]:
    entries = dep.get(
        f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}/state-store?map_index={map_index}"
    )["task_state_store"]
    return {e["key"]: e["value"] for e in entries}


# --------------------------------------------------------------------------- the test


def test_downstream_dag_runs_on_each_closed_round_and_the_state_stores_show_it(
    airflow_deployment: Callable[[Mapping[str, str], str], AirflowDeployment],
    tmp_path: Path,
    pg_url: str,
    pg_schema: str,
    pg_engine: sa.Engine,
    redis_url: str,
    redis_client: redis.Redis,
    key_prefix: str,
) -> None:
    _create_events(pg_engine)
    stream, deferred_stream = f"outbox-{uuid.uuid4().hex[:8]}", f"deferred-{uuid.uuid4().hex[:8]}"
    started = time.monotonic()
    dep = airflow_deployment(
        {
            "AIRFLOW__CORE__DAGS_FOLDER": str(_dags_folder(tmp_path)),
            f"AIRFLOW_CONN_{SOURCE_CONN.upper()}": ds.postgres_conn(pg_url, pg_schema),
            f"AIRFLOW_CONN_{REDIS_CONN.upper()}": ds.redis_conn(redis_url),
            # the example's settings (keyset_examples_common)
            "KEYSET_EXAMPLE_SOURCE_CONN": SOURCE_CONN,
            "KEYSET_EXAMPLE_REDIS_CONN": REDIS_CONN,
            "KEYSET_EXAMPLE_KEY_PREFIX": key_prefix,
            "KEYSET_EXAMPLE_OUTBOX_STREAM": stream,
            "KEYSET_EXAMPLE_OUTBOX_SCHEDULE": "",
            "KEYSET_EXAMPLE_MAX_RANGES": "2",
            "KEYSET_EXAMPLE_CHUNK_SIZE": "50",
            "KEYSET_EXAMPLE_RETRIES": "0",
            "KEYSET_EXAMPLE_POKE_INTERVAL": "1",
            "KEYSET_EXAMPLE_BARRIER_TIMEOUT": "120",
            # the deferred DAG's
            "KEYSET_ASSETS_SOURCE_CONN": SOURCE_CONN,
            "KEYSET_ASSETS_REDIS_CONN": REDIS_CONN,
            "KEYSET_ASSETS_KEY_PREFIX": key_prefix,
            "KEYSET_ASSETS_STREAM": deferred_stream,
            "KEYSET_ASSETS_SLEEP_S": "0.3",
            "KEYSET_ASSETS_CHUNK_SIZE": "50",
        },
        PRODUCER,
    )
    _wait_for_dags(dep, [PRODUCER, REPORT, DEFERRED, DEFERRED_REPORT])
    ready_s = time.monotonic() - started

    # 1 + 3: a chained round of the example, and the deferred barrier's round, at the same time
    t0 = time.monotonic()
    run_1 = _trigger(dep, PRODUCER)
    run_d = _trigger(dep, DEFERRED)
    _wait(dep, f"{PRODUCER} {run_1}", _run_done(dep, PRODUCER, run_1))
    reports = _wait(dep, f"{REPORT} after {run_1}", _reports_done(dep, REPORT, 1))
    _wait(dep, f"{DEFERRED} {run_d}", _run_done(dep, DEFERRED, run_d))
    deferred_reports = _wait(dep, f"{DEFERRED_REPORT}", _reports_done(dep, DEFERRED_REPORT, 1))
    first_s = time.monotonic() - t0

    totals = _xcom(dep, PRODUCER, run_1, "barrier")
    round_1 = {
        "round_id": "r1",
        "start_key": None,
        "end_key": ROWS,
        "done": ROWS,
        "skipped": 0,
        "dead": 0,
        "stream": stream,
        "watermark": ROWS,
    }
    assert totals == round_1
    assert [r["run_type"] for r in reports] == ["asset_triggered"]
    report = _xcom(dep, REPORT, reports[0]["dag_run_id"], "report")
    assert report == {"rounds": [round_1 | {"outbox_rows": ROWS}], "watermark": ROWS}
    events = _asset_events(dep, PRODUCER)
    assert [(e["name"], e["source_task_id"], e["source_run_id"], e["extra"]) for e in events] == [
        (f"keyset://{stream}", "barrier", run_1, round_1)
    ]
    assert [d["run_id"] for d in events[0]["created_dagruns"]] == [reports[0]["dag_run_id"]]
    asset = _asset(dep, f"keyset://{stream}")
    assert _asset_state(dep, asset["id"]) == {"watermark": ROWS, "last_round": round_1}
    ranges = _xcom(dep, PRODUCER, run_1, "plan")
    assert len(ranges) == 2
    for spec in ranges:
        entry = _task_state(dep, PRODUCER, run_1, "traverse", spec["range_id"])["keyset_range"]
        assert {
            k: entry[k]
            for k in (
                "round_id",
                "range_id",
                "lo",
                "hi",
                "cursor",
                "done",
                "complete",
                "try_number",
            )
        } == {
            "round_id": "r1",
            "range_id": spec["range_id"],
            "lo": spec["lo"],
            "hi": spec["hi"],
            "cursor": spec["hi"],
            "done": spec["hi"] - (spec["lo"] or 0),
            "complete": True,
            "try_number": 1,
        }

    # 3: the deferred barrier waited in the triggerer and still emitted the round
    deferred_round = {
        "round_id": "r1",
        "start_key": None,
        "end_key": ROWS,
        "done": ROWS,
        "skipped": 0,
        "dead": 0,
        "stream": deferred_stream,
        "watermark": ROWS,
    }
    assert _xcom(dep, DEFERRED_REPORT, deferred_reports[0]["dag_run_id"], "rounds") == [
        deferred_round
    ]
    assert [e["extra"] for e in _asset_events(dep, DEFERRED)] == [deferred_round]
    trigger_log = "\n".join(
        p.read_text(errors="replace")
        for p in (dep.home / "logs").rglob("*.log*")
        if f"run_id={run_d}" in str(p)
    ) + (dep.home / "triggerer.out").read_text(errors="replace")
    assert "round r1: every range is complete" in trigger_log, dep.diagnostics(DEFERRED)
    barrier_ti = dep.get(f"/dags/{DEFERRED}/dagRuns/{run_d}/taskInstances/barrier")
    assert (barrier_ti["state"], barrier_ti["try_number"]) == ("success", 1)

    # 2: re-run range 1 from its start, as "Trigger DAG w/ config" would
    t1 = time.monotonic()
    lo, hi = ranges[1]["lo"], ranges[1]["hi"]
    run_2 = _trigger(dep, PRODUCER, {"start_key": lo, "end_key": hi})
    _wait(dep, f"{PRODUCER} {run_2}", _run_done(dep, PRODUCER, run_2))
    reports = _wait(dep, f"{REPORT} after {run_2}", _reports_done(dep, REPORT, 2))
    rerun_s = time.monotonic() - t1
    round_2 = {
        "round_id": "r2",
        "start_key": lo,
        "end_key": hi,
        "done": 0,
        "skipped": hi - lo,
        "dead": 0,
        "stream": stream,
        "watermark": ROWS,
    }
    assert _xcom(dep, PRODUCER, run_2, "barrier") == round_2
    second = _xcom(dep, REPORT, reports[-1]["dag_run_id"], "report")
    assert second == {"rounds": [round_2 | {"outbox_rows": hi - lo}], "watermark": ROWS}
    assert [e["extra"]["round_id"] for e in _asset_events(dep, PRODUCER)] == ["r1", "r2"]
    assert _asset_state(dep, asset["id"]) == {"watermark": ROWS, "last_round": round_2}
    assert StreamControl(CursorStore(redis_client, stream, prefix=key_prefix)).watermark() == ROWS

    # 4: a clear is a new try of the same task instance: it resumes from the cursor in Redis (a
    # complete range returns at once, reading nothing) and its task state entry survives
    t2 = time.monotonic()
    _clear(dep, run_1, [["traverse", 1]])
    _wait(dep, f"{PRODUCER} {run_1} after the clear", _cleared_try_done(dep, run_1, 1))
    # The run must be finished again before the barrier is cleared: a clear leaves a running
    # run's state alone, and a scheduler that read the task instances just before the clear
    # commits "success" just after it, with the cleared barrier never run (nothing would then
    # emit the round again).
    _wait(dep, f"{PRODUCER} {run_1} finished again", _run_done(dep, PRODUCER, run_1))
    clear_s = time.monotonic() - t2
    result = _xcom(dep, PRODUCER, run_1, "traverse", map_index=1)
    assert (result["rows_read"], result["done"], result["complete"]) == (0, hi - lo, True), result
    entry = _task_state(dep, PRODUCER, run_1, "traverse", 1)["keyset_range"]
    assert (entry["try_number"], entry["cursor"], entry["done"], entry["complete"]) == (
        2,
        hi,
        hi - lo,
        True,
    )
    assert len(_asset_events(dep, PRODUCER)) == 2  # the barrier was not cleared: no new event

    # 5: clearing the barrier closes the (closed) round again with the same totals and emits the
    # same round again (at least once): the report runs a third time, for r1
    t3 = time.monotonic()
    _clear(dep, run_1, ["barrier"])
    reports = _wait(dep, f"{REPORT} after clearing the barrier", _reclosed(dep, run_1, 3))
    reclose_s = time.monotonic() - t3
    assert _xcom(dep, PRODUCER, run_1, "barrier") == round_1
    assert [e["extra"]["round_id"] for e in _asset_events(dep, PRODUCER)] == ["r1", "r2", "r1"]
    third = _xcom(dep, REPORT, reports[-1]["dag_run_id"], "report")
    assert third == {"rounds": [round_1 | {"outbox_rows": ROWS}], "watermark": ROWS}
    assert _asset_state(dep, asset["id"]) == {"watermark": ROWS, "last_round": round_1}

    FIGURES.append(
        f"assets: deployment ready in {ready_s:.0f} s; chained round ({ROWS} rows, 2 ranges) + "
        f"deferred round -> both reports in {first_s:.0f} s; re-run of range 1 ({hi - lo} keys) "
        f"-> report in {rerun_s:.0f} s; clear of a complete range -> try 2 done in "
        f"{clear_s:.0f} s; clear of the barrier -> report again in {reclose_s:.0f} s; "
        f"total {time.monotonic() - started:.0f} s"
    )
    print(FIGURES[-1])
