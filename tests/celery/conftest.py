"""Fixture ``celery_deployment`` (a CeleryExecutor deployment with two workers, see
``celery_support``) and the terminal summary of the figures the Celery test measured.

Skipped, with the reason, when Celery or the Celery provider cannot be imported, unless
``KEYSET_REQUIRE_SERVICES=1`` (CI), where that fails the test instead.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import _services
import celery_support as cs
import deployment_support as ds
import pytest

WORKERS = ("w1", "w2")


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    ds.write_figures(terminalreporter, "keyset celery scale-out", cs.FIGURES)


def _require_celery() -> None:
    try:
        for module in ("celery", "airflow.providers.celery.executors.celery_executor"):
            importlib.import_module(module)
    except Exception as exc:
        _services.skip_or_fail(
            f"Celery is not importable ({type(exc).__name__}: {exc}); install the extra: "
            "pip install -e '.[celery]'"
        )


@pytest.fixture
def celery_deployment(
    pg_url: str,
    redis_url: str,
    key_prefix: str,
    airflow_metadata_template: ds.MetadataTemplate,
    tmp_path: Path,
) -> Iterator[Callable[[Mapping[str, str], str], tuple[ds.AirflowDeployment, dict]]]:
    """``start(extra_env, dag_id)`` -> (deployment, {worker name: process}) once ``dag_id`` is
    ready and both workers consume the queue. Stopped, its database dropped at teardown."""
    _require_celery()
    with ds.Deployments(pg_url, airflow_metadata_template) as deployments:

        def start(extra_env: Mapping[str, str], dag_id: str) -> tuple[ds.AirflowDeployment, dict]:
            db_url = deployments.database_url()
            env = {**cs.celery_env(redis_url, f"{key_prefix}:celery:", db_url), **extra_env}
            home = tmp_path / "airflow-home"
            dep = ds.start_deployment(
                home,
                db_url,
                cs.DAGS_DIR,
                env,
                dag_id,
                deployments.started,
                migrate=not deployments.migrated,
            )
            workers = cs.start_workers(dep, list(WORKERS))
            return dep, workers

        yield start
