"""``@task.keyset_traverse`` and ``.round(...)``: the docs' decorator example
(``dags/cancel_stale_orders.py``) end to end under ``dag.test()`` on real PostgreSQL + Redis,
through the connection Airflow's PostgreSQL hook hands out (psycopg 3)."""

from __future__ import annotations

import datetime as dt

import pytest
import sqlalchemy as sa
from conftest import postgres_conn
from test_example_dags import states, xcom

pytestmark = pytest.mark.airflow

ORDERS_DDL = """
CREATE TABLE orders (
    id bigint PRIMARY KEY,
    created_at timestamptz NOT NULL,
    status text NOT NULL,
    cancel_reason text
);
CREATE UNIQUE INDEX orders_created_at_id ON orders (created_at, id);
"""


def make_orders(engine: sa.Engine, n: int) -> dict[int, str]:
    """``n`` orders, every seventh one PAID; the status of each by id."""
    t0 = dt.datetime(2026, 3, 1, tzinfo=dt.UTC)
    status = {i: "PAID" if i % 7 == 0 else "PENDING" for i in range(1, n + 1)}
    with engine.begin() as c:
        c.exec_driver_sql(ORDERS_DDL)
        c.execute(
            sa.text("INSERT INTO orders (id, created_at, status) VALUES (:i, :t, :s)"),
            [{"i": i, "t": t0 + dt.timedelta(seconds=i // 3), "s": s} for i, s in status.items()],
        )
    return status


def test_task_keyset_traverse_is_a_registered_decorator(airflow_env):
    from airflow.sdk import task

    from airflow_keyset_provider.decorators.keyset import keyset_traverse_task

    assert task.keyset_traverse is keyset_traverse_task


def test_the_decorator_example_cancels_stale_orders_with_a_reason(
    airflow_env, pg_url, pg_engine, monkeypatch
):
    monkeypatch.setenv("AIRFLOW_CONN_ORDERS_DB", postgres_conn(pg_url, airflow_env["schema"]))
    status = make_orders(pg_engine, 2500)
    import cancel_stale_orders as module

    dr = module.dag.test()
    assert dr.state == "success", states(dr)
    pending = [i for i, s in status.items() if s == "PENDING"]
    totals = xcom(dr, "cancel_stale.barrier")
    assert (totals["done"], totals["skipped"], totals["dead"]) == (len(pending), 0, 0)
    with pg_engine.connect() as c:
        rows = c.execute(sa.text("SELECT id, status, cancel_reason FROM orders")).all()
    got = {i: (s, r) for i, s, r in rows}
    for i, s in status.items():
        if s == "PAID":
            assert got[i] == ("PAID", None)
        else:
            assert got[i][0] == "CANCELLED" and got[i][1].startswith("unpaid since 2026-03-01 ")


REFUSE_TRIGGER = """
CREATE FUNCTION refuse_frozen() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.id IN (101, 1202, 1203, 2498) THEN
        RAISE EXCEPTION USING MESSAGE = 'order ' || NEW.id || ' is frozen by compliance';
    END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER orders_refuse_frozen BEFORE UPDATE ON orders
    FOR EACH ROW EXECUTE FUNCTION refuse_frozen();
"""


def test_the_flagship_scenario_dead_letters_the_rows_a_trigger_refuses(
    airflow_env, pg_url, pg_engine, monkeypatch
):
    """The documented production scenario end to end: a guarded write-back under
    ``where="status = 'PENDING'"``, a trigger that RAISEs for four rows, the driver Airflow's
    PostgreSQL hook hands out (psycopg 3). The four keys are retried, then dead-lettered with
    the trigger's class (its message withheld); every other PENDING order is cancelled; the round closes."""
    monkeypatch.setenv("AIRFLOW_CONN_ORDERS_DB", postgres_conn(pg_url, airflow_env["schema"]))
    status = make_orders(pg_engine, 2500)
    with pg_engine.begin() as c:
        c.exec_driver_sql(REFUSE_TRIGGER)
    from airflow.providers.postgres.hooks.postgres import PostgresHook

    assert PostgresHook(postgres_conn_id="orders_db").sqlalchemy_url.drivername == (
        "postgresql+psycopg"
    )
    import cancel_stale_orders as module

    dr = module.dag.test()
    assert dr.state == "success", states(dr)
    frozen = {101, 1202, 1203, 2498}
    pending = [i for i, s in status.items() if s == "PENDING"]
    totals = xcom(dr, "cancel_stale.barrier")
    assert (totals["done"], totals["skipped"], totals["dead"]) == (len(pending) - 4, 0, 4)
    with pg_engine.connect() as c:
        still = {i for (i,) in c.execute(sa.text("SELECT id FROM orders WHERE status = 'PENDING'"))}
    assert still == frozen
