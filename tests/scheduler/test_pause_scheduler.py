"""Pause during a mapped run under a real scheduler: the traverse tasks defer, resume finishes.

A real deployment (``conftest.py``: scheduler with LocalExecutor, DAG processor, triggerer, API
server) runs ``dags/keyset_scheduler_kill.py`` (no kill this time) over ``ROWS`` rows in two
ranges of chunks of ``CHUNK`` (50 ms each). Once each range has committed a few chunks the test
runs ``airflow-keyset pause`` (the CLI, against the same Redis). Checked:

- both traverse task instances reach state ``deferred`` (REST API) while the round is unfinished:
  each committed the chunk in hand, released its lease and handed its wait to
  ``KeysetResumeTrigger`` in the real triggerer; the default pool then runs nothing
  (``running_slots`` 0: the worker slots are free);
- while paused no cursor moves;
- after ``airflow-keyset resume`` the same tries (try 1) continue from their cursors and the run
  succeeds: every key delivered, none twice (the pause committed the chunk in hand), counters
  exact, the barrier closes the round.
"""

from __future__ import annotations

import io
import time
import uuid
from collections.abc import Callable, Mapping

import deployment_support as ds
import pytest
import redis
import sqlalchemy as sa
from scheduler_support import FIGURES, AirflowDeployment
from test_real_scheduler import (
    DAG_ID,
    REDIS_CONN,
    SOURCE_CONN,
    _create_tables,
    _effects,
    _ti_path,
    _xcom,
    _xcom_or_none,
)

from airflow_keyset_provider.cli import main as cli_main
from airflow_keyset_provider.core import StreamControl
from airflow_keyset_provider.core.store.cursor_store import CursorStore

ROWS = 3000
CHUNK = 15
PAUSE_AFTER_CHUNKS = 5
BOUND_S = 170.0  # the whole scenario, from the trigger to a finished run


def _cli(redis_url: str, key_prefix: str, *argv: str) -> str:
    out, err = io.StringIO(), io.StringIO()
    code = cli_main(
        [*argv, "--redis-url", redis_url, "--key-prefix", key_prefix], stdout=out, stderr=err
    )
    assert code == 0, err.getvalue()
    return out.getvalue()


def _wait(what: str, check: Callable[[], bool], deadline: float, dep: AirflowDeployment) -> float:
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}\n{dep.diagnostics(DAG_ID)}")
        if dep.dead_components():
            pytest.fail(
                f"Airflow components died: {dep.dead_components()}\n{dep.diagnostics(DAG_ID)}"
            )
        time.sleep(0.2)
    return time.monotonic()


def test_pause_defers_mapped_tasks_and_resume_completes_the_round(
    airflow_deployment: Callable[[Mapping[str, str], str], AirflowDeployment],
    pg_url: str,
    pg_schema: str,
    pg_engine: sa.Engine,
    redis_url: str,
    redis_client: redis.Redis,
    key_prefix: str,
) -> None:
    _create_tables(pg_engine)
    stream = f"pause-{uuid.uuid4().hex[:8]}"
    dep = airflow_deployment(
        {
            f"AIRFLOW_CONN_{SOURCE_CONN.upper()}": ds.postgres_conn(pg_url, pg_schema),
            f"AIRFLOW_CONN_{REDIS_CONN.upper()}": ds.redis_conn(redis_url),
            "KEYSET_SCHED_SOURCE_CONN": SOURCE_CONN,
            "KEYSET_SCHED_REDIS_CONN": REDIS_CONN,
            "KEYSET_SCHED_KEY_PREFIX": key_prefix,
            "KEYSET_SCHED_STREAM": stream,
            "KEYSET_SCHED_MAX_RANGES": "2",
            "KEYSET_SCHED_CHUNK_SIZE": str(CHUNK),
            "KEYSET_SCHED_SLEEP_S": "0.05",
            "KEYSET_SCHED_RETRIES": "0",
            "KEYSET_SCHED_RESUME_POLL_S": "1",
            "KEYSET_SCHED_BARRIER_TIMEOUT_S": str(int(BOUND_S)),
        },
        DAG_ID,
    )
    ctl = StreamControl(CursorStore(redis_client, stream, prefix=key_prefix))
    run_id = f"pause_{uuid.uuid4().hex[:8]}"
    started = time.monotonic()
    deadline = started + BOUND_S
    dep.request("POST", f"/dags/{DAG_ID}/dagRuns", {"dag_run_id": run_id, "logical_date": None})

    round_id: list[str] = []

    def both_ranges_going() -> bool:
        if not round_id:
            rid = _xcom_or_none(dep, run_id, "plan", "round_id")
            if rid is None:
                return False
            round_id.append(rid)
        return all(r["done"] >= PAUSE_AFTER_CHUNKS * CHUNK for r in ctl.range_status(round_id[0]))

    _wait("both ranges to commit a few chunks", both_ranges_going, deadline, dep)
    rid = round_id[0]
    _cli(redis_url, key_prefix, "pause", stream, "--reason", "scheduler test")
    paused_at = time.monotonic()

    def states() -> list[str]:
        return [dep.get(_ti_path(run_id, "traverse", i))["state"] for i in (0, 1)]

    deferred_at = _wait(
        "both traverse tasks deferred", lambda: states() == ["deferred", "deferred"], deadline, dep
    )
    pool = dep.get("/pools/default_pool")
    at_pause = [(r.cursor_encoded, r.done, r.owner) for r in ctl.range_status(rid)]
    assert all(not owner for _, _, owner in at_pause), f"leases not released: {at_pause}"
    assert not all(r.complete for r in ctl.range_status(rid)), "the round finished before the pause"
    time.sleep(3)
    assert [(r.cursor_encoded, r.done, r.owner) for r in ctl.range_status(rid)] == at_pause
    assert states() == ["deferred", "deferred"]
    status = _cli(redis_url, key_prefix, "status", stream, "--json")
    assert '"paused": true' in status

    _cli(redis_url, key_prefix, "resume", stream)
    resumed_at = time.monotonic()
    _wait(
        "the run to finish",
        lambda: dep.get(f"/dags/{DAG_ID}/dagRuns/{run_id}")["state"] in ("success", "failed"),
        deadline,
        dep,
    )
    finished = time.monotonic()
    state = dep.get(f"/dags/{DAG_ID}/dagRuns/{run_id}")["state"]
    assert state == "success", dep.diagnostics(DAG_ID)
    tis = [dep.get(_ti_path(run_id, "traverse", i)) for i in (0, 1)]
    ranges = _xcom(dep, run_id, "plan", "return_value")
    totals = _xcom(dep, run_id, "barrier", "return_value")
    fx = _effects(pg_engine, ranges)
    FIGURES.extend(
        [
            f"pause run {run_id}: paused after {paused_at - started:.1f} s; both tasks deferred "
            f"{deferred_at - paused_at:.1f} s after the pause; pool while paused: running "
            f"{pool.get('running_slots')} deferred {pool.get('deferred_slots')} occupied {pool.get('occupied_slots')}; "
            f"cursors at pause {[d for _, d, _ in at_pause]}; run finished {finished - resumed_at:.1f} s after "
            f"resume; total {finished - started:.0f} s",
            f"  keys lost {fx['lost']}, delivered twice in one try {fx['twice_in_one_try']}, tries "
            f"{[ti['try_number'] for ti in tis]}, barrier done {totals['done']}",
        ]
    )
    print("\n".join(FIGURES))
    assert pool.get("running_slots") == 0, pool
    assert [ti["try_number"] for ti in tis] == [1, 1] and [ti["state"] for ti in tis] == [
        "success"
    ] * 2
    assert fx["lost"] == 0 and fx["twice_in_one_try"] == 0 and fx["outside_range"] == 0, fx
    assert (totals["done"], totals["skipped"], totals["dead"]) == (ROWS, 0, 0), totals
    assert ctl.round(rid).state == "closed"
