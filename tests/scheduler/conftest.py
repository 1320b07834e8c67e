"""Fixture ``airflow_deployment`` (a real Airflow deployment, see ``scheduler_support``) and the
terminal summary of the figures the scheduler test measured."""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import pytest
import scheduler_support as ss
import sqlalchemy as sa
from sqlalchemy.engine import make_url
from sqlalchemy.pool import NullPool


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if ss.FIGURES:
        terminalreporter.section("keyset real scheduler")
        for line in ss.FIGURES:
            terminalreporter.write_line(line)


@pytest.fixture
def airflow_deployment(
    pg_url: str, tmp_path: Path
) -> Iterator[Callable[[Mapping[str, str], str], ss.AirflowDeployment]]:
    """``start(extra_env, dag_id)`` -> a ready ``AirflowDeployment`` (one per test).

    ``extra_env`` is added to the components' environment (``AIRFLOW_CONN_*``, the DAG's
    settings); ``dag_id`` is the DAG to wait for. Everything is stopped and dropped at teardown.
    """
    db_name = f"airflow_{secrets.token_hex(4)}"
    admin = sa.create_engine(pg_url, poolclass=NullPool, isolation_level="AUTOCOMMIT")
    use_sqlite = os.environ.get(ss.ENV_METADATA, "postgres").strip().lower() == "sqlite"
    deployments: list[ss.AirflowDeployment] = []
    created = False

    def start(extra_env: Mapping[str, str], dag_id: str) -> ss.AirflowDeployment:
        nonlocal created
        home = tmp_path / "airflow-home"
        if use_sqlite:
            db_url = f"sqlite:///{home / 'airflow.db'}"
        else:
            with admin.connect() as conn:
                conn.exec_driver_sql(f'CREATE DATABASE "{db_name}"')
            created = True
            db_url = make_url(pg_url).set(database=db_name).render_as_string(hide_password=False)
        return ss.start_deployment(home, db_url, extra_env, dag_id, deployments)

    try:
        yield start
    finally:
        for dep in deployments:
            dep.stop()
        if created:
            with admin.connect() as conn:
                conn.exec_driver_sql("SET lock_timeout = '30s'")
                conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{db_name}" WITH (FORCE)')
        admin.dispose()
