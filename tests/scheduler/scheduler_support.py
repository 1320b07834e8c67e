"""What the scheduler tests add to ``tests/deployment_support.py`` (the deployment itself, shared
with ``tests/celery``): their DAGs folder, the metadata choice and the figures they measured.

The fixture ``airflow_deployment`` (``conftest.py``) starts ``deployment_support``'s deployment
with its defaults: LocalExecutor, ``parallelism`` 2, the DAGs folder ``tests/scheduler/dags``, a
throwaway PostgreSQL metadata database (``KEYSET_SCHEDULER_METADATA=sqlite``: a SQLite file in
the home instead).
"""

from __future__ import annotations

from pathlib import Path

from deployment_support import HEARTBEAT_TIMEOUT_S, AirflowDeployment

HERE = Path(__file__).resolve().parent
DAGS_DIR = HERE / "dags"
ENV_METADATA = "KEYSET_SCHEDULER_METADATA"  # "postgres" (default) or "sqlite"

FIGURES: list[str] = []  # lines printed in the terminal summary (the measured figures)

__all__ = ["DAGS_DIR", "ENV_METADATA", "FIGURES", "HEARTBEAT_TIMEOUT_S", "AirflowDeployment"]
