"""The docs' decorator example, ``dags/cancel_stale_orders.py`` exactly as the docs show it, under
a real Airflow deployment (scheduler with LocalExecutor, DAG processor, triggerer, API server:
``deployment_support``): its scheduled run plans the round, the pulled traverse tasks cancel
every PENDING order with a reason through ``chunk.connection`` (the connection Airflow's
PostgreSQL hook hands out: psycopg 3), the deferrable barrier closes the round in the triggerer.

The DAGs folder holds that one file. The connections (``orders_db``, ``redis_default``) and the
key prefix (``[keyset] key_prefix``) come from the environment, so the file needs no settings.
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import deployment_support as ds
import pytest
import sqlalchemy as sa
from scheduler_support import FIGURES, AirflowDeployment

REPO = Path(__file__).resolve().parents[2]
DAG_ID = "cancel_stale_orders"
ROWS = 1200
RUN_TIMEOUT_S = 180.0


def _dags_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "dags"
    folder.mkdir()
    (folder / "cancel_stale_orders.py").symlink_to(REPO / "dags" / "cancel_stale_orders.py")
    return folder


def _create_orders(engine: sa.Engine) -> None:
    with engine.begin() as c:
        c.exec_driver_sql(
            "CREATE TABLE orders (id bigint PRIMARY KEY, created_at timestamptz NOT NULL, "
            "status text NOT NULL, cancel_reason text)"
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


def _finished_run(dep: AirflowDeployment) -> dict[str, Any] | None:
    runs = dep.get(f"/dags/{DAG_ID}/dagRuns?limit=10")["dag_runs"]
    done = [r for r in runs if r["state"] in ("success", "failed")]
    return done[0] if done else None


def test_the_decorator_example_runs_under_a_real_scheduler(
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
    dep = airflow_deployment(
        {
            "AIRFLOW__CORE__DAGS_FOLDER": str(_dags_folder(tmp_path)),
            "AIRFLOW_CONN_ORDERS_DB": ds.postgres_conn(pg_url, pg_schema),
            "AIRFLOW_CONN_REDIS_DEFAULT": ds.redis_conn(redis_url),
            "AIRFLOW__KEYSET__KEY_PREFIX": key_prefix,
        },
        DAG_ID,
    )
    # unpaused at creation: the scheduler creates the latest @daily run by itself
    end = time.monotonic() + RUN_TIMEOUT_S
    run = None
    while run is None and time.monotonic() < end:
        if dep.dead_components():
            pytest.fail(f"Airflow components died: {dep.dead_components()}\n{dep.diagnostics()}")
        run = _finished_run(dep)
        time.sleep(1)
    assert run is not None, f"no run of {DAG_ID} finished\n{dep.diagnostics(DAG_ID)}"
    assert run["state"] == "success", f"{run}\n{dep.diagnostics(DAG_ID)}"
    totals = ds.xcom(dep, DAG_ID, run["dag_run_id"], "cancel_stale.barrier", "return_value")
    pending = ROWS - ROWS // 5
    assert (totals["done"], totals["skipped"], totals["dead"]) == (pending, 0, 0)
    with pg_engine.connect() as c:
        counts = dict(
            c.execute(sa.text("SELECT status, count(*) FROM orders GROUP BY status")).all()
        )
        reasons = c.execute(
            sa.text("SELECT count(*) FROM orders WHERE cancel_reason LIKE 'unpaid since 2026-%'")
        ).scalar()
    assert counts == {"CANCELLED": pending, "PAID": ROWS // 5} and reasons == pending
    FIGURES.append(
        f"decorator example under a real scheduler: {pending} orders cancelled, run "
        f"{run['state']} {time.monotonic() - started:.0f} s after the deployment started"
    )
