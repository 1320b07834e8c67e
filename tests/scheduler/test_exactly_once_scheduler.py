"""``exactly_once`` under a real scheduler: ``dags/keyset_exactly_once_rollup.py`` copies
``ROWS`` sales into a roll-up table with no unique key, in two mapped ranges; the first try of
range 0 SIGKILLs itself in the middle of a chunk, after its insert. Checked: the run succeeds
(range 0 on its second try), every sale is in the roll-up exactly once, each range's ledger interval
on the target stands at the range's end with its count, and the barrier's totals are exact."""

from __future__ import annotations

import time
import uuid
from collections import Counter
from collections.abc import Callable, Mapping
from pathlib import Path

import deployment_support as ds
import pytest
import redis
import sqlalchemy as sa
from scheduler_support import FIGURES, AirflowDeployment

DAG_ID = "keyset_exactly_once_rollup"
ROWS = 2000
BOUND_S = 150.0


def _create_tables(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        conn.exec_driver_sql(
            "CREATE TABLE xo_sales (id bigint PRIMARY KEY, region text NOT NULL, "
            "amount_cents bigint NOT NULL)"
        )
        conn.exec_driver_sql(
            "INSERT INTO xo_sales SELECT g, 'r' || mod(g, 5), g * 10 "
            f"FROM generate_series(1, {ROWS}) g"
        )
        conn.exec_driver_sql(  # no unique key: a write done twice would stay
            "CREATE TABLE xo_rollup (sale_id bigint NOT NULL, region text NOT NULL, "
            "amount_cents bigint NOT NULL)"
        )


def test_exactly_once_rollup_under_a_real_scheduler(
    airflow_deployment: Callable[[Mapping[str, str], str], AirflowDeployment],
    pg_url: str,
    pg_schema: str,
    pg_engine: sa.Engine,
    redis_url: str,
    redis_client: redis.Redis,
    key_prefix: str,
) -> None:
    _create_tables(pg_engine)
    dep = airflow_deployment(
        {
            "AIRFLOW_CONN_KEYSET_XO_DB": ds.postgres_conn(pg_url, pg_schema),
            "AIRFLOW_CONN_KEYSET_XO_REDIS": ds.redis_conn(redis_url),
            "KEYSET_XO_KEY_PREFIX": key_prefix,
            "KEYSET_XO_KILL_AT": "4",
            # the components import this checkout's package (the venv may hold another one)
            "PYTHONPATH": str(Path(__file__).resolve().parents[2]),
        },
        DAG_ID,
    )
    run_id = f"xo_{uuid.uuid4().hex[:8]}"
    started = time.monotonic()
    dep.request("POST", f"/dags/{DAG_ID}/dagRuns", {"dag_run_id": run_id, "logical_date": None})
    while dep.get(f"/dags/{DAG_ID}/dagRuns/{run_id}")["state"] not in ("success", "failed"):
        if time.monotonic() - started > BOUND_S or dep.dead_components():
            pytest.fail(f"the run did not finish in {BOUND_S} s\n{dep.diagnostics(DAG_ID)}")
        time.sleep(0.5)
    seconds = time.monotonic() - started
    state = dep.get(f"/dags/{DAG_ID}/dagRuns/{run_id}")["state"]
    assert state == "success", dep.diagnostics(DAG_ID)
    path = f"/dags/{DAG_ID}/dagRuns/{run_id}/taskInstances/traverse"
    tries = [dep.get(f"{path}/{i}")["try_number"] for i in (0, 1)]
    with pg_engine.connect() as c:
        written = Counter(r[0] for r in c.execute(sa.text("SELECT sale_id FROM xo_rollup")))
        ledger = sorted(
            tuple(r)
            for r in c.execute(sa.text("SELECT range_id, done FROM keyset_ledger WHERE seg > 0"))
        )
    totals = ds.xcom(dep, DAG_ID, run_id, "barrier", "return_value")
    twice = sum(1 for n in written.values() if n > 1)
    missing = ROWS - len(written)
    FIGURES.append(
        f"exactly_once roll-up run {run_id}: {seconds:.0f} s, traverse tries {tries}, "
        f"{ROWS} sales, {missing} missing, {twice} written twice, ledger {ledger}"
    )
    assert tries[0] == 2, tries  # range 0's first try was killed mid-chunk
    assert written == Counter(range(1, ROWS + 1))
    assert [range_id for range_id, _ in ledger] == [0, 1] and sum(d for _, d in ledger) == ROWS
    assert (totals["done"], totals["skipped"], totals["dead"]) == (ROWS, 0, 0), totals
