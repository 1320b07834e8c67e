"""Shared fixtures: real PostgreSQL and real Redis, isolated per test, cleaned up afterwards.

Session: ``pg_url``, ``redis_url`` (servers resolved once per run, see ``tests/_services.py``).
Session, on first use: ``airflow_metadata_template`` (an Airflow metadata database migrated once,
copied by each deployment of ``tests/scheduler`` and ``tests/celery``, see
``deployment_support.MetadataTemplate``).
Per test: ``pg_schema``, ``pg_schema_url``, ``pg_engine``, ``sqlite_url``, ``redis_client``,
``key_prefix``, ``mariadb_db_url`` (a fresh MariaDB/MySQL database ``ks_<12 hex>``, skipped with
the reason printed when the server is unreachable, failed under ``KEYSET_REQUIRE_SERVICES=1``).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

# tests/ is deliberately not a package: pytest puts it on sys.path, so this import works here,
# in test modules and when another pytest run loads this file with ``-p conftest``.
import _services
import deployment_support
import pytest
import redis
import sqlalchemy as sa
from sqlalchemy.pool import NullPool

# Services used in this run, reported at the end so a log shows what the tests ran against.
_USED: list[_services.Service] = []


def _service(resolve: Callable[[], _services.Service]) -> _services.Service:
    try:
        service = resolve()
    except _services.ServiceUnavailable as exc:
        # Never skip: a missing service stops the whole run with a distinct exit code.
        pytest.exit(f"test services unavailable: {exc}", returncode=3)
    _USED.append(service)
    return service


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    for service in _USED:
        terminalreporter.write_line(f"keyset test service {service.describe()}")


# --------------------------------------------------------------------------- PostgreSQL


@pytest.fixture(scope="session")
def pg_url() -> Iterator[str]:
    """SQLAlchemy URL (``postgresql+psycopg2://``) of the server's ``test`` database."""
    service = _service(_services.resolve_postgres)
    yield service.url
    service.stop()


@pytest.fixture(scope="session")
def airflow_metadata_template(
    pg_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[deployment_support.MetadataTemplate]:
    """The session's migrated Airflow metadata database to copy (migrated when first copied),
    dropped at the end of the session."""
    template = deployment_support.MetadataTemplate(pg_url, tmp_path_factory.mktemp("airflow-tpl"))
    yield template
    template.drop()


@pytest.fixture
def pg_schema(pg_url: str) -> Iterator[str]:
    """A fresh schema ``kt_<8 hex>`` in the test database, dropped CASCADE afterwards."""
    name = f"kt_{uuid.uuid4().hex[:8]}"
    admin = sa.create_engine(pg_url, poolclass=NullPool)
    try:
        with admin.begin() as conn:
            conn.exec_driver_sql(f'CREATE SCHEMA "{name}"')
        yield name
        with admin.begin() as conn:
            # A connection the test leaked inside a transaction would block DROP forever;
            # fail the teardown loudly instead of hanging the run.
            conn.exec_driver_sql("SET LOCAL lock_timeout = '30s'")
            conn.exec_driver_sql(f'DROP SCHEMA IF EXISTS "{name}" CASCADE')
    finally:
        admin.dispose()


@pytest.fixture
def pg_schema_url(pg_url: str, pg_schema: str) -> str:
    """Like ``pg_url``, but connections have ``search_path`` = the test's schema."""
    return _services.with_search_path(pg_url, pg_schema)


@pytest.fixture
def pg_engine(pg_schema_url: str) -> Iterator[sa.Engine]:
    """Engine on ``pg_schema_url``; disposed (before the schema is dropped) at teardown."""
    engine = sa.create_engine(pg_schema_url)
    yield engine
    engine.dispose()


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    """SQLAlchemy URL of a fresh SQLite file in the test's tmp_path."""
    return f"sqlite:///{tmp_path / 'source.db'}"


# --------------------------------------------------------------------------- MariaDB / MySQL


@pytest.fixture(scope="session")
def mariadb_url() -> str:
    """SQLAlchemy URL (``mysql+pymysql://``) of the MariaDB/MySQL server's ``test`` database."""
    return _services.mariadb_url_or_skip()


@pytest.fixture
def mariadb_db_url(mariadb_url: str) -> Iterator[str]:
    """A fresh database ``ks_<12 hex>`` (utf8mb4), its URL; dropped afterwards."""
    name = f"ks_{uuid.uuid4().hex[:12]}"
    admin = sa.create_engine(mariadb_url, poolclass=NullPool)
    try:
        with admin.begin() as conn:
            conn.exec_driver_sql(f"CREATE DATABASE `{name}` CHARACTER SET utf8mb4")
        yield (
            sa.engine.make_url(mariadb_url).set(database=name).render_as_string(hide_password=False)
        )
        with admin.begin() as conn:
            # a connection the test leaked inside a transaction would block DROP: fail loudly
            conn.exec_driver_sql("SET SESSION lock_wait_timeout = 30")
            conn.exec_driver_sql(f"DROP DATABASE IF EXISTS `{name}`")
    finally:
        admin.dispose()


# --------------------------------------------------------------------------- Redis


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """URL usable with ``redis.Redis.from_url``."""
    service = _service(_services.resolve_redis)
    yield service.url
    service.stop()


@pytest.fixture
def redis_client(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


@pytest.fixture
def key_prefix(redis_url: str) -> Iterator[str]:
    """Unique ``kst<8 hex>``; every key the test writes must start with ``<prefix>:``.

    Teardown deletes ``<prefix>:*`` with SCAN (KEYS would block a shared server), using its
    own connection so it works even if the test closed or broke its client.
    """
    prefix = f"kst{uuid.uuid4().hex[:8]}"
    yield prefix
    _services.delete_prefix(redis_url, prefix)
