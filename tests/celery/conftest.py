"""Fixture ``celery_deployment`` (a CeleryExecutor deployment with two workers, see
``celery_support``) and the terminal summary of the figures the Celery test measured.

Skipped, with the reason, when Celery or the Celery provider cannot be imported, unless
``KEYSET_REQUIRE_SERVICES=1`` (CI), where that fails the test instead.
"""

from __future__ import annotations

import importlib
import os
import secrets
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import celery_support as cs
import pytest
import sqlalchemy as sa
from sqlalchemy.engine import make_url
from sqlalchemy.pool import NullPool

WORKERS = ("w1", "w2")


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if cs.FIGURES:
        terminalreporter.section("keyset celery scale-out")
        for line in cs.FIGURES:
            terminalreporter.write_line(line)


def _require_celery() -> None:
    try:
        for module in ("celery", "airflow.providers.celery.executors.celery_executor"):
            importlib.import_module(module)
    except Exception as exc:
        reason = (
            f"Celery is not importable ({type(exc).__name__}: {exc}); install the extra: "
            "pip install -e '.[celery]'"
        )
        if os.environ.get("KEYSET_REQUIRE_SERVICES", "").strip().lower() in {
            "1",
            "true",
            "yes",
            "on",
        }:
            pytest.fail(f"{reason} (KEYSET_REQUIRE_SERVICES=1 forbids skipping)")
        print(f"\nSKIP: {reason}")
        pytest.skip(reason)


@pytest.fixture
def celery_deployment(
    pg_url: str, redis_url: str, key_prefix: str, tmp_path: Path
) -> Iterator[Callable[[Mapping[str, str], str], tuple[cs.ss.AirflowDeployment, dict]]]:
    """``start(extra_env, dag_id)`` -> (deployment, {worker name: process}) once ``dag_id`` is
    ready and both workers consume the queue. Stopped, its database dropped at teardown."""
    _require_celery()
    db_name = f"airflow_{secrets.token_hex(4)}"
    admin = sa.create_engine(pg_url, poolclass=NullPool, isolation_level="AUTOCOMMIT")
    deployments: list[cs.ss.AirflowDeployment] = []
    created = False

    def start(extra_env: Mapping[str, str], dag_id: str) -> tuple[cs.ss.AirflowDeployment, dict]:
        nonlocal created
        with admin.connect() as conn:
            conn.exec_driver_sql(f'CREATE DATABASE "{db_name}"')
        created = True
        db_url = make_url(pg_url).set(database=db_name).render_as_string(hide_password=False)
        env = {**cs.celery_env(redis_url, f"{key_prefix}:celery:", db_url), **extra_env}
        dep = cs.ss.start_deployment(tmp_path / "airflow-home", db_url, env, dag_id, deployments)
        workers = cs.start_workers(dep, list(WORKERS))
        return dep, workers

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
