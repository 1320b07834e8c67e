"""Fixture ``airflow_deployment`` (a real Airflow deployment, see ``deployment_support`` and
``scheduler_support``) and the terminal summary of the figures the scheduler test measured."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import deployment_support as ds
import pytest
import scheduler_support as ss


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    ds.write_figures(terminalreporter, "keyset real scheduler", ss.FIGURES)


@pytest.fixture
def airflow_deployment(
    pg_url: str, airflow_metadata_template: ds.MetadataTemplate, tmp_path: Path
) -> Iterator[Callable[[Mapping[str, str], str], ds.AirflowDeployment]]:
    """``start(extra_env, dag_id)`` -> a ready ``AirflowDeployment`` (one per test).

    ``extra_env`` is added to the components' environment (``AIRFLOW_CONN_*``, the DAG's
    settings); ``dag_id`` is the DAG to wait for. Everything is stopped and dropped at teardown.
    """
    use_sqlite = os.environ.get(ss.ENV_METADATA, "postgres").strip().lower() == "sqlite"
    with ds.Deployments(pg_url, airflow_metadata_template) as deployments:

        def start(extra_env: Mapping[str, str], dag_id: str) -> ds.AirflowDeployment:
            home = tmp_path / "airflow-home"
            db_url = (
                f"sqlite:///{home / 'airflow.db'}" if use_sqlite else deployments.database_url()
            )
            return ds.start_deployment(
                home,
                db_url,
                ss.DAGS_DIR,
                extra_env,
                dag_id,
                deployments.started,
                migrate=use_sqlite or not deployments.migrated,
            )

        yield start
