"""Airflow test harness: a throwaway, migrated ``AIRFLOW_HOME`` and per-test connections.

Airflow reads its configuration when it is first imported, so the environment is set here, at
import time of this conftest (before any test module of this folder imports Airflow):
``AIRFLOW_HOME`` in a temporary directory, SQLite metadata, no example DAGs, and a DAGs folder that
links the repository's ``dags/*.py`` and this folder's ``keyset_test_dags.py`` (``dag.test()``
only runs DAGs that the DAG bundle contains). ``airflow db migrate`` runs once per session in a
subprocess.

Per test (fixture ``airflow_env``): the examples' connection ``keyset_examples_db`` points at the
test's fresh PostgreSQL schema (``search_path`` via the ``sqlalchemy_query`` extra),
``redis_default`` at the test Redis, and the examples' Redis key prefix is wiped before and after.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import _services
import pytest
from sqlalchemy.engine import make_url

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
SESSION_PREFIX = f"kstaf{uuid.uuid4().hex[:8]}"

# Airflow reads its configuration (and opens its metadata database) when first imported.
_IMPORTED_TOO_EARLY = "airflow" in sys.modules and not os.environ.get("KEYSET_AIRFLOW_HOME_READY")

_HOME = Path(tempfile.mkdtemp(prefix="keyset-airflow-home-"))
atexit.register(shutil.rmtree, _HOME, True)
DAGS_DIR = _HOME / "dags"
DAGS_DIR.mkdir()
for source in [*sorted((REPO / "dags").glob("*.py")), *sorted(HERE.glob("keyset_*dags.py"))]:
    (DAGS_DIR / source.name).symlink_to(source)

AIRFLOW_ENV = {
    "AIRFLOW_HOME": str(_HOME),
    "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
    "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{_HOME / 'airflow.db'}",
    "AIRFLOW__CORE__DAGS_FOLDER": str(DAGS_DIR),
    "AIRFLOW__CORE__UNIT_TEST_MODE": "False",
    "AIRFLOW__LOGGING__LOGGING_LEVEL": "INFO",
    "KEYSET_AIRFLOW_HOME_READY": "1",
    # DAG-shaping settings of the examples: fixed for the session (the DAG files read them once)
    "KEYSET_EXAMPLE_SOURCE_CONN": "keyset_examples_db",
    "KEYSET_EXAMPLE_REDIS_CONN": "redis_default",
    "KEYSET_EXAMPLE_KEY_PREFIX": SESSION_PREFIX,
    # the prefix of DAGs that name none (``[keyset] key_prefix``: the decorator example)
    "AIRFLOW__KEYSET__KEY_PREFIX": SESSION_PREFIX,
    "KEYSET_EXAMPLE_MAX_RANGES": "4",
    "KEYSET_EXAMPLE_CHUNK_SIZE": "50",
    "KEYSET_EXAMPLE_RETRIES": "1",
    "KEYSET_EXAMPLE_RETRY_DELAY_SECONDS": "0",
    "KEYSET_EXAMPLE_POKE_INTERVAL": "0.5",
    "KEYSET_EXAMPLE_BARRIER_TIMEOUT": "60",
}
os.environ.update(AIRFLOW_ENV)
sys.path.insert(0, str(DAGS_DIR))


@pytest.fixture(scope="session")
def airflow_home() -> Path:
    """The migrated throwaway AIRFLOW_HOME (migration runs once per session)."""
    if _IMPORTED_TOO_EARLY:
        pytest.fail(
            "airflow was imported before tests/airflow/conftest.py could point it at a throwaway "
            "AIRFLOW_HOME; run the Airflow tests in a pytest process of their own"
        )
    marker = _HOME / ".migrated"
    if not marker.exists():
        airflow_bin = Path(sys.executable).with_name("airflow")
        cmd = [str(airflow_bin)] if airflow_bin.exists() else [sys.executable, "-m", "airflow"]
        proc = subprocess.run(
            [*cmd, "db", "migrate"],
            env={**os.environ, **AIRFLOW_ENV},
            capture_output=True,
            text=True,
            timeout=300,
        )
        if proc.returncode != 0:
            pytest.fail(f"airflow db migrate failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        marker.touch()
    return _HOME


def postgres_conn(pg_url: str, schema: str) -> str:
    """An Airflow ``postgres`` connection (JSON) whose sessions see only ``schema``."""
    url = make_url(pg_url)
    return json.dumps(
        {
            "conn_type": "postgres",
            "host": url.host,
            "port": url.port,
            "login": url.username,
            "password": url.password,
            "schema": url.database,
            "extra": {"sqlalchemy_query": {"options": f"-csearch_path={schema}"}},
        }
    )


def redis_conn(redis_url: str) -> str:
    url = make_url(redis_url)
    return json.dumps(
        {
            "conn_type": "redis",
            "host": url.host,
            "port": url.port,
            "extra": {"db": int(url.database or 0)},
        }
    )


@pytest.fixture
def airflow_env(
    airflow_home: Path, pg_url: str, pg_schema: str, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> Iterator[dict[str, Any]]:
    """Connections for this test (fresh schema, test Redis); the examples' prefix wiped around it."""
    monkeypatch.setenv("AIRFLOW_CONN_KEYSET_EXAMPLES_DB", postgres_conn(pg_url, pg_schema))
    monkeypatch.setenv("AIRFLOW_CONN_REDIS_DEFAULT", redis_conn(redis_url))
    _services.delete_prefix(redis_url, SESSION_PREFIX)
    forget_stream_records()
    yield {
        "home": airflow_home,
        "prefix": SESSION_PREFIX,
        "redis_url": redis_url,
        "schema": pg_schema,
    }
    _services.delete_prefix(redis_url, SESSION_PREFIX)
    forget_stream_records()


def forget_stream_records() -> None:
    """Delete the streams' durable records in Airflow (the asset state of every ``keyset://``
    asset, ``airflow_keyset_provider.durable_record``): each test's streams start new, as their
    Redis prefix does (the session's metadata database outlives a test)."""
    import sqlalchemy as sa
    from airflow.models.asset import AssetModel
    from airflow.models.asset_state_store import AssetStateStoreModel
    from airflow.utils.session import create_session

    with create_session() as session:
        ids = sa.select(AssetModel.id).where(AssetModel.name.like("keyset://%"))
        session.execute(
            sa.delete(AssetStateStoreModel).where(AssetStateStoreModel.asset_id.in_(ids))
        )
